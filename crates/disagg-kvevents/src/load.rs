//! The engines' own load reports: how much prefill work waits on each engine, whoever
//! sent it.
//!
//! A router's own counts see only the requests it sent: with several proxies in front
//! of the same engines, each sees its share of every queue. SGLang (0.5.23,
//! `python/sglang/srt/managers/scheduler_components/load_publisher.py`, opt-in with
//! `--load-publish-endpoint auto|tcp://…`) publishes each scheduler's load on a ZMQ
//! `PUB` socket of its own, framed as its KV events: `[b"load", seq, payload]`, with
//! `payload` msgpack of an array-tagged `LoadStat`:
//!
//! ```text
//! ["LoadStat", num_running_reqs, num_waiting_reqs, num_tokens, max_total_num_tokens,
//!  attn_dp_rank, num_waiting_uncached_tokens, num_total_tokens, max_running_requests,
//!  total_prefill_uncached_tokens, total_prefill_busy_us]
//! ```
//!
//! The first four positions are required; later ones were appended over releases and
//! default to 0 when absent; positions beyond these are ignored. A changed load is
//! published at once and an unchanged one every second. Rank `r` publishes on the
//! range's base port plus `r`; with `auto` the base is the KV-events port plus the
//! ranks (after the replay ports when they would overlap).
//!
//! [`LoadBoard`] keeps each (engine, rank)'s latest report and when it came; the
//! scorer prices an engine's queue by it ([`crate::score`]). vLLM 0.33 publishes no
//! such report: for its engines the scorer counts the work it sent itself.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::event::DecodeError;
use crate::msgpack::Reader;

/// The topic of SGLang's load messages.
pub const LOAD_TOPIC: &[u8] = b"load";

/// One scheduler's load, as SGLang's `LoadStat` reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadStat {
    /// Requests running (in the batch being computed).
    pub running: u64,
    /// Requests waiting in the queue.
    pub waiting: u64,
    /// KV tokens in use.
    pub kv_tokens: u64,
    /// KV capacity in tokens (0 when the engine does not know).
    pub kv_capacity: u64,
    /// Uncached prompt tokens of the waiting requests: the prefill work queued (0 from
    /// releases before the field).
    pub waiting_uncached_tokens: u64,
}

/// Decodes a `LoadStat` payload (array-tagged, see the [module docs](self)).
///
/// # Errors
///
/// [`DecodeError::Msgpack`] for bytes that are not msgpack, [`DecodeError::Untagged`]
/// for anything but an array led by `"LoadStat"`, [`DecodeError::Field`] when one of
/// the first four positions (or a later one present) is not a non-negative integer.
pub fn decode_load(payload: &[u8]) -> Result<LoadStat, DecodeError> {
    let mut r = Reader::new(payload);
    let items = r.array()?.ok_or(DecodeError::Untagged)?;
    if items == 0 || r.str()? != Some(b"LoadStat") {
        return Err(DecodeError::Untagged);
    }
    // Positions 1 to 6 (after the tag), read in order; later ones are not read.
    let mut values = [None; 7];
    for (position, slot) in values.iter_mut().enumerate().take(items).skip(1) {
        // Position 5 is `attn_dp_rank` (informational, may be nil): the socket's rank
        // is what counts.
        if position == 5 {
            r.skip()?;
            continue;
        }
        *slot = Some(match r.int()? {
            Some(i) => i.as_u64(),
            None => {
                r.skip()?;
                None
            }
        });
    }
    let field = |position: usize, name: &'static str, required: bool| {
        let bad = DecodeError::Field {
            event: "LoadStat",
            field: name,
        };
        match values[position] {
            Some(Some(v)) => Ok(v),
            Some(None) => Err(bad),
            None if required => Err(bad),
            None => Ok(0),
        }
    };
    Ok(LoadStat {
        running: field(1, "num_running_reqs", true)?,
        waiting: field(2, "num_waiting_reqs", true)?,
        kv_tokens: field(3, "num_tokens", true)?,
        kv_capacity: field(4, "max_total_num_tokens", true)?,
        waiting_uncached_tokens: field(6, "num_waiting_uncached_tokens", false)?,
    })
}

/// Each engine's latest load reports, per data-parallel rank.
///
/// Written by the subscriber, read by the scorer on the request path: one short lock,
/// a map lookup per candidate. An engine that leaves the set is removed with its index
/// entries ([`crate::KvIndex::remove_engine`]).
#[derive(Debug, Default)]
pub struct LoadBoard {
    by_engine: Mutex<HashMap<Arc<str>, Vec<RankLoad>>>,
}

/// One rank's latest report: (rank, report, when it came).
type RankLoad = (u32, LoadStat, Instant);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics under this lock; a half-updated board is still a valid one.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LoadBoard {
    /// Records `stat` as `engine`'s rank `dp_rank` load, received at `at`.
    pub fn record(&self, engine: &str, dp_rank: u32, stat: LoadStat, at: Instant) {
        let mut map = lock(&self.by_engine);
        let ranks = match map.get_mut(engine) {
            Some(ranks) => ranks,
            None => map.entry(Arc::from(engine)).or_default(),
        };
        match ranks.iter_mut().find(|(r, _, _)| *r == dp_rank) {
            Some(slot) => *slot = (dp_rank, stat, at),
            None => ranks.push((dp_rank, stat, at)),
        }
    }

    /// The latest report of `engine`'s rank `dp_rank` if it came within `max_age` of
    /// `now`.
    pub fn get(
        &self,
        engine: &str,
        dp_rank: u32,
        now: Instant,
        max_age: Duration,
    ) -> Option<LoadStat> {
        self.get_received(engine, dp_rank, now, max_age)
            .map(|(stat, _)| stat)
    }

    /// The latest fresh report of `engine`'s rank with the least queued prefill work
    /// (an engine's balancer sends new work to its least loaded rank).
    pub fn least_loaded(&self, engine: &str, now: Instant, max_age: Duration) -> Option<LoadStat> {
        self.least_loaded_received(engine, now, max_age)
            .map(|(stat, _)| stat)
    }

    /// [`get`](Self::get), with when the report came.
    pub(crate) fn get_received(
        &self,
        engine: &str,
        dp_rank: u32,
        now: Instant,
        max_age: Duration,
    ) -> Option<(LoadStat, Instant)> {
        lock(&self.by_engine)
            .get(engine)?
            .iter()
            .find(|(r, _, at)| *r == dp_rank && fresh(*at, now, max_age))
            .map(|&(_, stat, at)| (stat, at))
    }

    /// [`least_loaded`](Self::least_loaded), with when the report came.
    pub(crate) fn least_loaded_received(
        &self,
        engine: &str,
        now: Instant,
        max_age: Duration,
    ) -> Option<(LoadStat, Instant)> {
        lock(&self.by_engine)
            .get(engine)?
            .iter()
            .filter(|(_, _, at)| fresh(*at, now, max_age))
            .map(|&(_, stat, at)| (stat, at))
            .min_by_key(|(stat, _)| stat.waiting_uncached_tokens)
    }

    /// Forgets an engine's reports.
    pub fn remove_engine(&self, engine: &str) {
        lock(&self.by_engine).remove(engine);
    }
}

fn fresh(at: Instant, now: Instant, max_age: Duration) -> bool {
    now.saturating_duration_since(at) <= max_age
}

#[cfg(test)]
mod tests {
    use rmpv::Value;

    use super::*;
    use crate::event::encode;

    fn stat(fields: &[Value]) -> Vec<u8> {
        let mut items = vec![Value::from("LoadStat")];
        items.extend_from_slice(fields);
        encode(&Value::Array(items))
    }

    #[test]
    fn decodes_current_and_older_shapes() {
        let current = stat(&[
            3.into(),
            5.into(),
            1000.into(),
            8000.into(),
            Value::Nil,
            4096.into(),
            5096.into(),
            64.into(),
            123.into(),
            456.into(),
            // A field a newer release appended.
            7.into(),
        ]);
        let s = decode_load(&current).unwrap();
        assert_eq!(
            (s.running, s.waiting, s.waiting_uncached_tokens),
            (3, 5, 4096)
        );
        assert_eq!((s.kv_tokens, s.kv_capacity), (1000, 8000));
        // The six-position prefix of older releases: no uncached tokens.
        let older = stat(&[1.into(), 2.into(), 10.into(), 20.into(), 0.into()]);
        assert_eq!(decode_load(&older).unwrap().waiting_uncached_tokens, 0);
    }

    #[test]
    fn refuses_what_is_not_a_load_stat() {
        assert!(matches!(
            decode_load(b"\x93\x01"),
            Err(DecodeError::Msgpack(_))
        ));
        let other = encode(&Value::Array(vec!["BlockStored".into()]));
        assert_eq!(decode_load(&other), Err(DecodeError::Untagged));
        let short = stat(&[1.into(), 2.into()]);
        assert!(matches!(
            decode_load(&short),
            Err(DecodeError::Field {
                field: "num_tokens",
                ..
            })
        ));
        let negative = stat(&[
            1.into(),
            2.into(),
            3.into(),
            4.into(),
            0.into(),
            (-1).into(),
        ]);
        assert!(decode_load(&negative).is_err());
    }

    #[test]
    fn reports_age_out_and_leave_with_their_engine() {
        let board = LoadBoard::default();
        let t0 = Instant::now();
        let busy = LoadStat {
            waiting_uncached_tokens: 900,
            ..LoadStat::default()
        };
        let idle = LoadStat {
            waiting_uncached_tokens: 100,
            ..LoadStat::default()
        };
        board.record("e", 0, busy, t0);
        board.record("e", 1, idle, t0);
        let age = Duration::from_secs(3);
        assert_eq!(board.get("e", 0, t0, age), Some(busy));
        assert_eq!(board.least_loaded("e", t0, age), Some(idle));
        let later = t0 + Duration::from_secs(4);
        assert_eq!(board.get("e", 0, later, age), None);
        assert_eq!(board.least_loaded("e", later, age), None);
        board.remove_engine("e");
        assert_eq!(board.get("e", 0, t0, age), None);
    }
}
