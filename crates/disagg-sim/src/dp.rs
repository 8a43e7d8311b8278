//! Data-parallel ranks: on which rank an engine places a request, as vLLM
//! and SGLang decide it.
//!
//! * **vLLM** reads the `X-data-parallel-rank` header; without it, its own
//!   load balancer picks a rank ([`Balancer`]).
//! * **SGLang** reads the `X-Data-Parallel-Rank` header, else the body's
//!   `routed_dp_rank`, else its deprecated alias `data_parallel_rank`; without
//!   any, a prefill follows the bootstrap room (`room % dp_size`) and a decode
//!   takes turns ([`SglangRanks`]). A decode also learns which rank of the
//!   prefill holds its KV from `disagg_prefill_dp_rank` (or the
//!   `x-override-disagg-prefill-dp-rank` header).

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use http::HeaderMap;
use serde_json::{Map, Value};

use crate::api::ApiError;
use crate::kv::lock;
use crate::lax;

/// The header a vLLM engine reads its data-parallel rank from (vLLM's
/// serving layer reads `X-data-parallel-rank`; header names are
/// case-insensitive, and SGLang reads the same name).
pub(crate) const DP_RANK_HEADER: &str = "x-data-parallel-rank";
/// SGLang's header that overrides the body's `disagg_prefill_dp_rank`
/// (`x-override-*` family, applied last).
pub(crate) const PREFILL_RANK_HEADER: &str = "x-override-disagg-prefill-dp-rank";

fn out_of_range(what: &str, rank: i64, dp_size: usize) -> ApiError {
    ApiError::bad_request(format!(
        "{what}: rank {rank} out of range, the engine has {dp_size} data-parallel ranks"
    ))
}

/// A rank read from a request, checked against the engine's ranks.
fn in_range(what: &str, rank: i64, dp_size: usize) -> Result<usize, ApiError> {
    usize::try_from(rank)
        .ok()
        .filter(|r| *r < dp_size)
        .ok_or_else(|| out_of_range(what, rank, dp_size))
}

/// The integer value of a header, as Python's `int()` reads it; `Ok(None)`
/// when the header is absent.
fn header_int(headers: &HeaderMap, name: &str) -> Result<Option<i64>, String> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    let text = String::from_utf8_lossy(value.as_bytes());
    text.trim()
        .parse::<i64>()
        .map(Some)
        .map_err(|_| text.into_owned())
}

/// The rank a vLLM request is pinned to by `X-data-parallel-rank`; `None`
/// leaves the choice to the [`Balancer`].
pub(crate) fn vllm_pinned_rank(
    headers: &HeaderMap,
    dp_size: usize,
) -> Result<Option<usize>, ApiError> {
    match header_int(headers, DP_RANK_HEADER) {
        Ok(None) => Ok(None),
        Ok(Some(rank)) => in_range("X-data-parallel-rank", rank, dp_size).map(Some),
        Err(_) => Err(ApiError::bad_request(
            "X-data-parallel-rank: should be a number",
        )),
    }
}

/// vLLM's own placement of requests that name no rank.
///
/// vLLM's DP client sends an unpinned request to the rank with the least
/// load (waiting and running requests, as the DP coordinator reports them
/// every 100 ms, plus the requests it placed since). That timing cannot be
/// reproduced; the simulator keeps its own count of requests in flight per
/// rank and breaks ties round robin, starting after the rank it chose last
/// (as if rank 0 had just been chosen when the engine starts). So
/// consecutive unpinned requests land on different ranks and rank 0 is not
/// favoured: a proxy that leaves the prefill leg unpinned but names one
/// rank's engine id to the decode fails at once, as it would sooner or later
/// against vLLM.
#[derive(Debug)]
pub(crate) struct Balancer {
    state: Mutex<BalanceState>,
}

#[derive(Debug)]
struct BalanceState {
    /// Requests in flight per rank.
    load: Vec<u64>,
    /// The rank the balancer chose last.
    last: usize,
}

impl Balancer {
    pub(crate) fn new(dp_size: usize) -> Self {
        Self {
            state: Mutex::new(BalanceState {
                load: vec![0; dp_size.max(1)],
                last: 0,
            }),
        }
    }

    /// Places a request: on `pinned` if given, else on the least loaded
    /// rank. The rank counts as loaded until the returned guard is dropped.
    pub(crate) fn place(self: &Arc<Self>, pinned: Option<usize>) -> RankLoad {
        let mut state = lock(&self.state);
        let n = state.load.len();
        let rank = match pinned {
            Some(rank) => rank.min(n - 1),
            None => {
                let start = state.last + 1;
                let rank = (start..start + n)
                    .map(|r| r % n)
                    .min_by_key(|r| state.load[*r])
                    .unwrap_or(0);
                state.last = rank;
                rank
            }
        };
        state.load[rank] += 1;
        RankLoad {
            balancer: Arc::clone(self),
            rank,
        }
    }
}

/// A request in flight on a rank of a [`Balancer`]; unloads it when dropped.
#[derive(Debug)]
pub(crate) struct RankLoad {
    balancer: Arc<Balancer>,
    rank: usize,
}

impl RankLoad {
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }
}

impl Drop for RankLoad {
    fn drop(&mut self) {
        let mut state = lock(&self.balancer.state);
        if let Some(load) = state.load.get_mut(self.rank) {
            *load = load.saturating_sub(1);
        }
    }
}

/// What an SGLang request says about data-parallel ranks, read as SGLang
/// 0.5.23 reads it (`python/sglang/srt/entrypoints/` request headers,
/// `managers/io_struct.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SglangRanks {
    /// The rank the request is pinned to: the `X-Data-Parallel-Rank` header
    /// (which wins over the body), else `routed_dp_rank`, else the deprecated
    /// `data_parallel_rank` (SGLang migrates it to `routed_dp_rank`).
    /// `data_parallel_rank_decode` means nothing to SGLang.
    pub(crate) pinned: Option<usize>,
    /// `disagg_prefill_dp_rank` (or `x-override-disagg-prefill-dp-rank`,
    /// which overrides it): the prefill rank that holds a decode's KV. Not
    /// checked against this engine's ranks: it names the peer's.
    pub(crate) prefill_rank: Option<u32>,
}

impl SglangRanks {
    pub(crate) fn read(
        headers: &HeaderMap,
        body: &Map<String, Value>,
        dp_size: usize,
    ) -> Result<Self, ApiError> {
        let header = header_int(headers, DP_RANK_HEADER).map_err(|v| {
            ApiError::bad_request(format!(
                "Invalid X-Data-Parallel-Rank header: must be an integer, got '{v}'"
            ))
        })?;
        let routed = lax::opt_int(body, "routed_dp_rank")?;
        let legacy = lax::opt_int(body, "data_parallel_rank")?;
        let pinned = match (header, routed, legacy) {
            (Some(r), _, _) => Some(in_range("X-Data-Parallel-Rank", r, dp_size)?),
            (None, Some(r), _) => Some(in_range("routed_dp_rank", r, dp_size)?),
            (None, None, Some(r)) => Some(in_range("data_parallel_rank", r, dp_size)?),
            (None, None, None) => None,
        };
        let header_hint = header_int(headers, PREFILL_RANK_HEADER).map_err(|v| {
            ApiError::bad_request(format!(
                "invalid {PREFILL_RANK_HEADER} header '{v}': not an integer"
            ))
        })?;
        let hint = match header_hint {
            Some(h) => Some(h),
            None => lax::opt_int(body, "disagg_prefill_dp_rank")?,
        };
        let prefill_rank = hint
            .map(|h| {
                u32::try_from(h).map_err(|_| {
                    ApiError::bad_request(format!(
                        "disagg_prefill_dp_rank: {h} is not a data-parallel rank"
                    ))
                })
            })
            .transpose()?;
        Ok(Self {
            pinned,
            prefill_rank,
        })
    }
}

/// SGLang's `round_robin` load balancing, a decode's default: ranks in
/// turn from rank 0.
#[derive(Debug, Default)]
pub(crate) struct RoundRobin(AtomicUsize);

impl RoundRobin {
    pub(crate) fn next(&self, dp_size: usize) -> usize {
        self.0.fetch_add(1, Relaxed) % dp_size.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn balancer_spreads_unpinned_requests_and_starts_after_rank_0() {
        let b = Arc::new(Balancer::new(3));
        // One at a time: round robin from rank 1.
        let ranks: Vec<usize> = (0..6).map(|_| b.place(None).rank()).collect();
        assert_eq!(ranks, [1, 2, 0, 1, 2, 0]);
        // Held: the least loaded rank wins over the turn.
        let busy1 = b.place(Some(1));
        let busy2 = b.place(Some(2));
        let a = b.place(None);
        assert_eq!(a.rank(), 0);
        let c = b.place(None);
        assert_eq!(c.rank(), 1, "all loaded once: the turn after rank 0");
        drop((busy1, busy2, a, c));
        assert_eq!(Arc::new(Balancer::new(1)).place(None).rank(), 0);
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn sglang_rank_sources_in_order() {
        let read = |h: &[(&'static str, &'static str)], body: Value| {
            SglangRanks::read(&headers(h), body.as_object().unwrap(), 4)
        };
        let body =
            json!({"routed_dp_rank": 1, "data_parallel_rank": 2, "disagg_prefill_dp_rank": 3});
        assert_eq!(
            read(&[("x-data-parallel-rank", "0")], body.clone()).unwrap(),
            SglangRanks {
                pinned: Some(0),
                prefill_rank: Some(3)
            }
        );
        assert_eq!(read(&[], body).unwrap().pinned, Some(1));
        assert_eq!(
            read(&[], json!({"data_parallel_rank": 2})).unwrap().pinned,
            Some(2)
        );
        // The decode-only field of old routers means nothing.
        assert_eq!(
            read(&[], json!({"data_parallel_rank_decode": 2})).unwrap(),
            SglangRanks {
                pinned: None,
                prefill_rank: None
            }
        );
        assert_eq!(
            read(
                &[(PREFILL_RANK_HEADER, "2")],
                json!({"disagg_prefill_dp_rank": 1})
            )
            .unwrap()
            .prefill_rank,
            Some(2)
        );
        assert!(read(&[("x-data-parallel-rank", "x")], json!({})).is_err());
        assert!(read(&[], json!({"routed_dp_rank": 4})).is_err());
        assert!(read(&[], json!({"routed_dp_rank": -1})).is_err());
        assert!(read(&[(PREFILL_RANK_HEADER, "a")], json!({})).is_err());
    }

    #[test]
    fn round_robin_from_rank_0() {
        let rr = RoundRobin::default();
        let ranks: Vec<usize> = (0..5).map(|_| rr.next(3)).collect();
        assert_eq!(ranks, [0, 1, 2, 0, 1]);
    }
}
