//! SGLang's bootstrap protocol: the request fields, the prefill's bootstrap
//! server and the decode's client for it.

use std::collections::HashSet;
use std::io;
use std::time::Duration;

use http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio::io::BufReader;
use tokio::net::TcpStream;
use tokio::time::timeout;

use crate::api::{ApiError, CompletionRequest};
use crate::body::Endpoint;
use crate::dp::{RoundRobin, SglangRanks};
use crate::generate::{KvDigest, kv_digest};
use crate::kv::{self, BootstrapResponse, KvTransferError, peer_gone};
use crate::rendezvous::Rendezvous;
use crate::stats::Counters;

/// SGLang's default `--disaggregation-bootstrap-port`, used by a decode when
/// the request's `bootstrap_port` is null.
pub(crate) const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// KV registered by a prefill under (data-parallel rank, room): each rank
/// of an SGLang prefill serves the rooms of its own requests.
pub(crate) type Rooms = Rendezvous<(u32, u64), KvDigest>;

/// The line a decode sends to a prefill's SGLang bootstrap server to take the
/// KV of a room; answered by a [`BootstrapResponse`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootstrapRequest {
    /// The request's `bootstrap_room`.
    pub room: u64,
    /// The prefill's data-parallel rank the decode expects the room on: the
    /// request's `disagg_prefill_dp_rank`. `None` (omitted on the wire): the
    /// decode follows the bootstrap room, and the server resolves the rank
    /// as `room % dp_size` of the prefill (SGLang's decode reads the
    /// prefill's `dp_size` from its bootstrap server to compute it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
}

/// One element of a (possibly batched) SGLang request.
#[derive(Debug)]
pub(crate) struct Element {
    pub(crate) host: Option<String>,
    pub(crate) port: u16,
    pub(crate) room: u64,
    /// The data-parallel rank of this engine that serves the element.
    pub(crate) rank: u32,
    /// Decode: the prefill rank named by `disagg_prefill_dp_rank`.
    pub(crate) prefill_rank: Option<u32>,
    /// The KV of the element's prompt.
    pub(crate) digest: KvDigest,
}

/// Where an SGLang engine places the elements of a request.
#[derive(Debug)]
pub(crate) struct Placement<'a> {
    pub(crate) ranks: SglangRanks,
    pub(crate) dp_size: usize,
    /// A decode's balancer for elements no rank is named for.
    pub(crate) round_robin: &'a RoundRobin,
}

impl Placement<'_> {
    /// The rank of an element: the pinned one, else a prefill follows the
    /// bootstrap room and a decode takes turns (SGLang's default
    /// `load_balance_method` per role, `follow_bootstrap_room` and
    /// `round_robin`, in `managers/data_parallel_controller.py`).
    fn rank(&self, room: u64, decode: bool) -> u32 {
        let rank = match self.ranks.pinned {
            Some(rank) => rank,
            None if decode => self.round_robin.next(self.dp_size),
            None => follow_room(room, self.dp_size),
        };
        u32::try_from(rank).unwrap_or(0)
    }
}

/// The rank `follow_bootstrap_room` gives a room.
pub(crate) fn follow_room(room: u64, dp_size: usize) -> usize {
    usize::try_from(room % dp_size.max(1) as u64).unwrap_or(0)
}

/// An SGLang prefill's check of its rank (`CommonKVSender.__init__` in
/// `python/sglang/srt/disaggregation/common/conn.py`): with several ranks,
/// and unless the request names `disagg_prefill_dp_rank` (then the decode
/// knows where to look), a request must run on the rank its room implies,
/// because the decode will look for the room there. Otherwise the transfer
/// fails at once with SGLang's own message.
pub(crate) fn check_follow_room(
    elements: &[Element],
    placement: &Placement<'_>,
) -> Result<(), String> {
    if placement.dp_size <= 1 || placement.ranks.prefill_rank.is_some() {
        return Ok(());
    }
    for e in elements {
        let implied = follow_room(e.room, placement.dp_size);
        if e.rank as usize != implied {
            return Err(format!(
                "follow_bootstrap_room conflict: dispatched to dp_rank {} but bootstrap_room {} implies dp_rank {implied}. Set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed routing.",
                e.rank, e.room
            ));
        }
    }
    Ok(())
}

/// How SGLang expands a request (`GenerateReqInput.normalize_batch_and_arguments`
/// in `srt/managers/io_struct.py`): B prompts, `None` for a single prompt, and `n`
/// samples of each. A single prompt with one sample is a single request, whose
/// bootstrap fields are scalars; anything else is B·n requests (one prompt with
/// `n` > 1 a batch of one), each taking its own element of the fields.
struct Expansion {
    prompts: Option<usize>,
    samples: usize,
}

impl Expansion {
    fn of(body: &Map<String, Value>, request: &CompletionRequest) -> Self {
        let samples = request.n.max(1) as usize;
        let prompts = if let Some(native) = &request.native {
            // `/generate`: a `text` list or an `input_ids` list of lists.
            native.prompt_list.then_some(request.prompts.len())
        } else {
            match request.endpoint {
                Endpoint::Chat => None,
                Endpoint::Completions => match body.get("prompt") {
                    Some(Value::Array(items))
                        if items.iter().all(Value::is_string)
                            || items.iter().all(Value::is_array) =>
                    {
                        Some(items.len())
                    }
                    _ => None,
                },
            }
        };
        Expansion { prompts, samples }
    }

    /// How many requests: `None` for a single one.
    fn requests(&self) -> Option<usize> {
        if self.prompts.is_none() && self.samples == 1 {
            return None;
        }
        Some(self.prompts.unwrap_or(1) * self.samples)
    }

    /// The prompt of expanded request `i`: SGLang repeats the prompt list once per
    /// sample (`_expand_inputs`), so request `i` is prompt `i mod B`.
    fn prompt(&self, i: usize) -> usize {
        i % self.prompts.unwrap_or(1).max(1)
    }
}

/// The per-request values of a bootstrap field, as SGLang normalizes them
/// (`_normalize_bootstrap_params`): for a single request the value itself; for
/// `n_requests` of them, null or absent for each, a single value for each (a room `R`
/// becomes `R`, `R + 1`, ...), or a list repeated once per sample of which the first
/// `n_requests` entries are used. `None` where null.
fn field(
    body: &Map<String, Value>,
    key: &str,
    expansion: &Expansion,
) -> Result<Vec<Option<Value>>, ApiError> {
    let value = body.get(key).filter(|v| !v.is_null());
    let Some(n) = expansion.requests() else {
        return match value {
            Some(Value::Array(_)) => Err(ApiError::bad_request(format!(
                "{key}: a single request takes a single value, not a list"
            ))),
            v => Ok(vec![v.cloned()]),
        };
    };
    match value {
        None => Ok(vec![None; n]),
        Some(Value::Array(items)) => {
            // The list, `samples` times over: its first `n` entries.
            let repeated = items.len().saturating_mul(expansion.samples);
            if repeated < n {
                return Err(ApiError::bad_request(format!(
                    "{key}: a batch of {n} requests takes a list of at least {} values, got {}",
                    n.div_ceil(expansion.samples),
                    items.len()
                )));
            }
            Ok((0..n)
                .map(|i| {
                    Some(&items[i % items.len()])
                        .filter(|v| !v.is_null())
                        .cloned()
                })
                .collect())
        }
        Some(v) if key == "bootstrap_room" => {
            // `[bootstrap_room + i for i in range(num)]`.
            let room = v
                .as_u64()
                .filter(|r| i64::try_from(*r).is_ok())
                .ok_or_else(|| {
                    ApiError::bad_request("bootstrap_room: should be an integer in [0, 2^63)")
                })?;
            Ok((0..n as u64)
                .map(|i| Some(Value::from(room.saturating_add(i))))
                .collect())
        }
        Some(v) => Ok(vec![Some(v.clone()); n]),
    }
}

/// Reads and validates the bootstrap fields of a request, one element per request
/// SGLang makes of it ([`Expansion`]), with the KV of each element's prompt. A
/// prefill needs every room, a decode every host and room. A room that two elements
/// share collides on the engines: the request is refused.
pub(crate) fn elements(
    body: &Value,
    request: &CompletionRequest,
    model: &str,
    block_size: usize,
    decode: bool,
    placement: &Placement<'_>,
) -> Result<Vec<Element>, ApiError> {
    let empty = Map::new();
    let body = body.as_object().unwrap_or(&empty);
    let expansion = Expansion::of(body, request);
    let hosts = field(body, "bootstrap_host", &expansion)?;
    let ports = field(body, "bootstrap_port", &expansion)?;
    let rooms = field(body, "bootstrap_room", &expansion)?;
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(rooms.len());
    for (i, ((host, port), room)) in hosts.into_iter().zip(ports).zip(rooms).enumerate() {
        let host = match host {
            None => None,
            Some(Value::String(h)) => Some(h),
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
                "bootstrap_room: room {room} appears twice in the batch (as SGLang expands it, \
                 a list repeated once per sample); its requests would collide on the engines"
            )));
        }
        // Chat elements share the conversation; completion element i is its prompt's.
        let prompt = match request.endpoint {
            Endpoint::Chat => request.prompts.first(),
            Endpoint::Completions => request.prompts.get(expansion.prompt(i)),
        }
        .map_or(&[][..], Vec::as_slice);
        out.push(Element {
            host,
            port,
            room,
            rank: placement.rank(room, decode),
            prefill_rank: placement.ranks.prefill_rank,
            digest: kv_digest(model, block_size, prompt.iter().copied()),
        });
    }
    // SGLang 0.5.23's tokenizer manager then sends a prompt's `n` samples, and a
    // `max_new_tokens: 0` warm-up before them, to its scheduler each with the room of
    // the prompt's first element (`managers/tokenizer_manager.py`
    // `_handle_batch_request`): with `n > 1` every prompt's room is taken several
    // times, which the engines' KV managers refuse, whatever rooms the request carried.
    if expansion.samples > 1
        && let Some(first) = out.first()
    {
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!(
                "KV transfer failed: Duplicate or cancelled bootstrap room {}: the {} samples \
                 of a prompt (and its warm-up) share the room of its first element",
                first.room, expansion.samples
            ),
        ));
    }
    Ok(out)
}

/// Serves one bootstrap connection: request lines, each answered by one
/// line once the room is registered on the rank the decode expects (or the
/// wait runs out: a room registered on another rank never reaches it, as
/// between SGLang engines). A rank the prefill does not have fails at once,
/// as SGLang's `/route` query does. A decode that leaves while waiting takes
/// nothing.
pub(crate) async fn serve_bootstrap(
    rooms: &Rooms,
    counters: &Counters,
    wait: Duration,
    dp_size: usize,
    mut stream: TcpStream,
) -> io::Result<()> {
    let (read, mut write) = stream.split();
    let mut reader = BufReader::new(read);
    while let Some(line) = kv::next_line(&mut reader).await? {
        let answer = match serde_json::from_slice::<BootstrapRequest>(&line) {
            Err(e) => BootstrapResponse::failure(format!("malformed request: {e}")),
            Ok(BootstrapRequest { room, dp_rank }) => {
                let rank = dp_rank
                    .unwrap_or_else(|| u32::try_from(follow_room(room, dp_size)).unwrap_or(0));
                if rank as usize >= dp_size.max(1) {
                    BootstrapResponse::failure(format!(
                        "could not fetch bootstrap info for prefill_dp_rank {rank}: the prefill has {dp_size} data-parallel ranks"
                    ))
                } else {
                    let key = (rank, room);
                    tokio::select! {
                        taken = rooms.take(counters, &key, wait) => kv::taken_or_timed_out(
                            counters,
                            taken,
                            || format!("room {room} was not registered on dp rank {rank} within {wait:?}"),
                        ),
                        () = peer_gone(&mut reader) => return Ok(()),
                    }
                }
            }
        };
        kv::write_line(&mut write, &answer).await?;
    }
    Ok(())
}

/// Takes the KV of one room from the bootstrap server at `host:port`,
/// waiting for the prefill as long as the caller lets it.
async fn fetch_one(
    host: &str,
    port: u16,
    request: BootstrapRequest,
) -> Result<KvDigest, KvTransferError> {
    let room = request.room;
    let mut stream = kv::connect(host, port)
        .await
        .map_err(|e| KvTransferError::Unreachable {
            addr: format!("{host}:{port}"),
            reason: match e {
                KvTransferError::Connect { source, .. } => source.to_string(),
                other => other.to_string(),
            },
        })?;
    let answer: BootstrapResponse =
        kv::request_line(&mut stream, &request)
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
        let request = BootstrapRequest {
            room,
            dp_rank: e.prefill_rank,
        };
        let remote = timeout(wait, fetch_one(host, e.port, request))
            .await
            .map_err(|_| {
                KvTransferError::PeerTimeout(format!("no prefill for room {room} within {wait:?}"))
            })??;
        kv::check_kv(&remote, &e.digest)
    });
    futures::future::try_join_all(fetches).await.map(drop)
}
