//! The journal of the blocks the engines' events removed, which the scorers read to drop
//! what they hold provisionally for an engine once the engine says it no longer has it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::lock;

/// The most recent removals kept for the scorers: a scorer that falls further behind
/// (none decided while thousands of blocks went) misses the oldest, whose provisional
/// entries then last their time.
const REMOVALS_KEPT: usize = 4096;

/// One block an engine's events removed.
#[derive(Debug)]
struct Removal {
    seq: u64,
    engine: Arc<str>,
    dp_rank: u32,
    key: u64,
}

/// The last [`REMOVALS_KEPT`] removals, each numbered.
#[derive(Debug, Default)]
pub(super) struct Journal {
    log: Mutex<VecDeque<Removal>>,
    /// The sequence number the next removal gets: read without the lock, so a reader
    /// with nothing new to read takes no lock.
    next: AtomicU64,
}

impl Journal {
    /// Calls `f(engine, dp_rank, key)` for each removal numbered `cursor` or later that
    /// is still kept, and moves `cursor` past the last one.
    pub(super) fn since(&self, cursor: &mut u64, mut f: impl FnMut(&str, u32, u64)) {
        if self.next.load(Ordering::Acquire) == *cursor {
            return;
        }
        let log = lock(&self.log);
        let first = log.partition_point(|r| r.seq < *cursor);
        for r in log.range(first..) {
            f(&r.engine, r.dp_rank, r.key);
        }
        *cursor = log.back().map_or(*cursor, |r| r.seq + 1);
    }

    /// Records that `engine`'s rank `dp_rank` no longer holds the blocks `keys`.
    pub(super) fn record(&self, engine: &str, dp_rank: u32, keys: &[u64]) {
        let engine: Arc<str> = Arc::from(engine);
        let mut log = lock(&self.log);
        for &key in keys {
            if log.len() == REMOVALS_KEPT {
                log.pop_front();
            }
            let seq = self.next.load(Ordering::Relaxed);
            log.push_back(Removal {
                seq,
                engine: Arc::clone(&engine),
                dp_rank,
                key,
            });
            self.next.store(seq + 1, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_sees_each_removal_once_and_the_oldest_go_past_the_cap() {
        let j = Journal::default();
        let mut cursor = 0;
        let mut seen = Vec::new();
        j.since(&mut cursor, |_, _, k| seen.push(k));
        assert!(seen.is_empty());
        j.record("e", 1, &[10, 11]);
        j.since(&mut cursor, |e, r, k| {
            seen.push((e.len() as u64) * 1000 + u64::from(r) * 100 + k)
        });
        assert_eq!(seen, [1110, 1111]);
        j.since(&mut cursor, |_, _, k| seen.push(k));
        assert_eq!(seen.len(), 2, "nothing new: nothing read again");
        let keys: Vec<u64> = (0..REMOVALS_KEPT as u64 + 5).collect();
        j.record("e", 0, &keys);
        let mut again = Vec::new();
        j.since(&mut cursor, |_, _, k| again.push(k));
        assert_eq!(again.len(), REMOVALS_KEPT);
        assert_eq!(again.first(), Some(&5), "the oldest five were dropped");
    }
}
