//! Unit tests of `score`.

use super::*;
use crate::event::{BlockHash, BlockStored, EventBatch, KvEvent};
use crate::index::IndexConfig;

fn index_with(engine: &str, tokens: &[u32]) -> Arc<KvIndex> {
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    store(&index, engine, tokens);
    index
}

fn store(index: &KvIndex, engine: &str, tokens: &[u32]) {
    let blocks = tokens.len() / 16;
    let stored = BlockStored {
        block_hashes: (0..blocks as u64)
            .map(|b| BlockHash::Int(candidate_tag(engine, None) ^ b))
            .collect(),
        token_ids: tokens[..blocks * 16].to_vec(),
        block_size: 16,
        ..BlockStored::default()
    };
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(stored)],
        dp_rank: None,
    };
    index.apply(engine, 0, &batch);
}

fn cands<'a>(loads: &[(&'a str, usize)]) -> Vec<Candidate<'a>> {
    loads
        .iter()
        .map(|&(engine, in_flight)| Candidate::new(engine, in_flight))
        .collect()
}

#[test]
fn longest_cached_prefix_wins_when_loads_are_equal() {
    let prompt: Vec<u32> = (0..256).collect();
    let index = index_with("b", &prompt[..160]);
    let scorer = KvScorer::new(index, ScorerConfig::default());
    let d = scorer
        .choose(&prompt, &cands(&[("a", 0), ("b", 0), ("c", 0)]))
        .unwrap();
    assert_eq!((d.index, d.cached_tokens, d.uncached_tokens), (1, 160, 96));
    assert_eq!(d.dp_rank, Some(0));
    // The 96 uncached tokens count as queued on b while the caller counts the
    // request in flight there, and no longer once it does not.
    assert_eq!(scorer.queued_tokens(&Candidate::new("b", 1)), 96);
    assert_eq!(scorer.queued_tokens(&Candidate::new("b", 0)), 0);
}

fn weight(miss_weight: u64) -> ScorerConfig {
    ScorerConfig {
        miss_weight,
        ..ScorerConfig::default()
    }
}

#[test]
fn load_outweighs_a_prefix_worth_less_than_the_queue() {
    let prompt: Vec<u32> = (0..256).collect();
    let index = index_with("b", &prompt[..160]);
    // A scorer that sent b three requests of 100 uncached tokens, each counted by
    // the caller; the decisions below come a second later.
    let t0 = Instant::now();
    let later = t0 + Duration::from_secs(1);
    let busy_b = || {
        let scorer = KvScorer::new(Arc::clone(&index), weight(1));
        for k in 1..=3u32 {
            let other: Vec<u32> = (k * 5000..k * 5000 + 100).collect();
            let c = cands(&[("b", k as usize - 1)]);
            let d = scorer.choose_at(&other, &c, t0).unwrap();
            assert_eq!(d.uncached_tokens, 100);
        }
        scorer
    };
    // Two still in flight: b costs 96 uncached + 200 queued = 296 > a: 256 + 0.
    let c = cands(&[("a", 0), ("b", 2)]);
    assert_eq!(busy_b().choose_at(&prompt, &c, later).unwrap().index, 0);
    // One: 96 + 100 = 196 < 256.
    let c = cands(&[("a", 0), ("b", 1)]);
    assert_eq!(busy_b().choose_at(&prompt, &c, later).unwrap().index, 1);
}

#[test]
fn a_pick_the_caller_has_not_counted_yet_is_in_flight() {
    let prompt: Vec<u32> = (0..256).collect();
    let index = index_with("b", &prompt[..160]);
    let scorer = KvScorer::new(index, weight(1));
    let t0 = Instant::now();
    // A request of 200 uncached tokens just sent to b, which the caller does not
    // count yet (its count still reads 0): b costs 96 + 200 = 296 > a's 256.
    let other: Vec<u32> = (5000..5200).collect();
    scorer.choose_at(&other, &cands(&[("b", 0)]), t0);
    let c = cands(&[("a", 0), ("b", 0)]);
    let soon = t0 + Duration::from_millis(1);
    assert_eq!(scorer.choose_at(&prompt, &c, soon).unwrap().index, 0);
    // Past `load_report_lag` the caller's count is believed: a 0 there means the
    // request ended, and b's prefix wins (96 < 256).
    let scorer = KvScorer::new(Arc::clone(scorer.index()), weight(1));
    scorer.choose_at(&other, &cands(&[("b", 0)]), t0);
    let later = t0 + DEFAULT_LOAD_REPORT_LAG + Duration::from_millis(1);
    assert_eq!(scorer.choose_at(&prompt, &c, later).unwrap().index, 1);
}

#[test]
fn in_flight_beyond_the_window_counts_at_the_mean() {
    let window: VecDeque<u32> = (1..=RECENT_PICKS as u32).map(|_| 10).collect();
    assert_eq!(queued_by_us(&window, 3), 30);
    assert_eq!(
        queued_by_us(&window, RECENT_PICKS + 5),
        10 * (RECENT_PICKS as u64 + 5)
    );
    assert_eq!(queued_by_us(&VecDeque::new(), 7), 0);
    // The newest count first.
    let mixed: VecDeque<u32> = [1000, 1, 2].into_iter().collect();
    assert_eq!(queued_by_us(&mixed, 2), 3);
}

#[test]
fn an_engine_report_prices_work_other_routers_sent() {
    let prompt: Vec<u32> = (0..256).collect();
    let index = index_with("b", &prompt[..160]);
    let now = Instant::now();
    // Three requests of other routers waiting, with `tokens` uncached tokens.
    let report = |tokens| crate::load::LoadStat {
        waiting: 3,
        waiting_uncached_tokens: tokens,
        ..Default::default()
    };
    // b reports 300 uncached tokens waiting that this scorer never sent: 96 + 300
    // > 256, so a wins although nothing of ours is in flight on b.
    index.loads().record("b", 0, report(300), now);
    // (A fresh scorer per decision: each records a provisional entry.)
    let scorer = || KvScorer::new(Arc::clone(&index), weight(1));
    let c = cands(&[("a", 0), ("b", 0)]);
    assert_eq!(scorer().choose_at(&prompt, &c, now).unwrap().index, 0);
    assert_eq!(scorer().queued_tokens(&Candidate::new("b", 0)), 300);
    // A stale report no longer counts: b's prefix wins again.
    let later = now + DEFAULT_LOAD_MAX_AGE + Duration::from_millis(1);
    assert_eq!(scorer().choose_at(&prompt, &c, later).unwrap().index, 1);
    // Our own count wins when it is the larger: 200 queued by us against a
    // report of 50 makes b cost 296 > 256.
    index.loads().record("b", 0, report(50), later);
    let ours = scorer();
    for k in 1..=2u32 {
        let other: Vec<u32> = (k * 5000..k * 5000 + 100).collect();
        ours.choose_at(&other, &cands(&[("b", 0)]), later);
    }
    let c = cands(&[("a", 0), ("b", 2)]);
    assert_eq!(ours.choose_at(&prompt, &c, later).unwrap().index, 0);
}

#[test]
fn an_engine_reporting_u64_max_load_is_the_dearest_not_the_cheapest() {
    let prompt: Vec<u32> = (0..256).collect();
    // b holds the longer prefix, so only its load can make a win.
    let index = index_with("b", &prompt[..160]);
    let now = Instant::now();
    let hostile = crate::load::LoadStat {
        waiting: u64::MAX,
        running: u64::MAX,
        waiting_uncached_tokens: u64::MAX,
        ..Default::default()
    };
    index.loads().record("b", 0, hostile, now);
    let scorer = KvScorer::new(Arc::clone(&index), weight(1));
    // b costs 96 + u64::MAX, saturated: a (256 + 0) is chosen; a wrap would make b
    // cost 95, the cheapest.
    let c = cands(&[("a", 0), ("b", 0)]);
    assert_eq!(scorer.choose_at(&prompt, &c, now).unwrap().index, 0);
    assert_eq!(scorer.queued_tokens(&Candidate::new("b", 0)), u64::MAX);
}

#[test]
fn a_report_of_only_our_own_requests_is_not_counted() {
    let prompt: Vec<u32> = (0..256).collect();
    let index = index_with("b", &prompt[..160]);
    let now = Instant::now();
    // b reports 2 requests (1 waiting, 1 running) and 400 uncached tokens: with 2
    // of ours in flight there, that is only our own work, which we price (nothing
    // sent by this scorer yet: 0), so b's prefix wins: 96 < 256.
    let ours = crate::load::LoadStat {
        waiting: 1,
        running: 1,
        waiting_uncached_tokens: 400,
        ..Default::default()
    };
    index.loads().record("b", 0, ours, now);
    let scorer = || KvScorer::new(Arc::clone(&index), weight(1));
    let c = cands(&[("a", 0), ("b", 2)]);
    assert_eq!(scorer().choose_at(&prompt, &c, now).unwrap().index, 1);
    // With one of ours in flight, the other request is someone else's: counted.
    let c = cands(&[("a", 0), ("b", 1)]);
    assert_eq!(scorer().choose_at(&prompt, &c, now).unwrap().index, 0);
}

#[test]
fn a_report_made_before_one_of_our_requests_ended_is_still_ours() {
    let prompt: Vec<u32> = (0..256).collect();
    let index = index_with("b", &prompt[..160]);
    let ms = Duration::from_millis;
    let t0 = Instant::now();
    let scorer = KvScorer::new(Arc::clone(&index), weight(1));
    // Two requests of 100 uncached tokens sent to b: the caller counts 2 there.
    for (k, in_flight) in [(1u32, 0usize), (2, 1)] {
        let other: Vec<u32> = (k * 5000..k * 5000 + 100).collect();
        let d = scorer.choose_at(&other, &cands(&[("b", in_flight)]), t0);
        assert_eq!(d.unwrap().uncached_tokens, 100);
    }
    // b reports them (300 uncached tokens by its own count) a moment later.
    let report = |waiting, tokens| crate::load::LoadStat {
        waiting,
        running: 1,
        waiting_uncached_tokens: tokens,
        ..Default::default()
    };
    index.loads().record("b", 0, report(1, 300), t0 + ms(1));
    // 20 ms on, one of them has ended (the caller counts 1) and b's report of the
    // end has not come: the report still holds our two requests only, so b costs
    // 96 + 100 (the one left) = 196 < a's 256.
    let t1 = t0 + ms(20);
    let c = cands(&[("a", 0), ("b", 1)]);
    assert_eq!(scorer.choose_at(&prompt, &c, t1).unwrap().index, 1);
    // Compared with the count of the moment, as a scorer with no history of b
    // must, the report shows a request more than the caller's: priced as another
    // router's work, 96 + 300 = 396 > 256.
    let fresh = KvScorer::new(Arc::clone(&index), weight(1));
    assert_eq!(fresh.choose_at(&prompt, &c, t1).unwrap().index, 0);
    // A report of more requests than the caller ever had there is still others'
    // work: 3 against at most 2 of ours, 96 + 500 > 256.
    let t2 = t1 + ms(20);
    index.loads().record("b", 0, report(2, 500), t2);
    let c = cands(&[("a", 0), ("b", 2)]);
    assert_eq!(scorer.choose_at(&prompt, &c, t2).unwrap().index, 0);
}

#[test]
fn the_count_history_is_bounded_in_length_and_age() {
    let t0 = Instant::now();
    let keep = Duration::from_secs(3);
    let mut sent = Sent::default();
    for i in 0..10 * COUNT_HISTORY {
        sent.observe(t0, i % 2, keep);
    }
    assert!(sent.counts.len() <= COUNT_HISTORY);
    // Unchanged counts are not recorded again.
    let len = sent.counts.len();
    sent.observe(t0, sent.counts.back().unwrap().1, keep);
    assert_eq!(sent.counts.len(), len);
    // One change a second: the changes of the last 3 s and the one before them.
    let mut sent = Sent::default();
    for i in 0..100u64 {
        sent.observe(t0 + Duration::from_secs(i), i as usize, keep);
    }
    let kept: Vec<usize> = sent.counts.iter().map(|&(_, n)| n).collect();
    assert_eq!(kept, [96, 97, 98, 99]);
    // What the caller counted around a moment: the count then and every change
    // until the end of the span, not those after it.
    let at = |s| t0 + Duration::from_secs(s);
    assert_eq!(sent.in_flight_between(at(97), at(98), 0), 98);
    assert_eq!(sent.in_flight_between(at(96), at(96), 0), 96);
    // Nothing seen by then: the current count.
    assert_eq!(sent.in_flight_between(at(1), at(2), 7), 7);
}

#[test]
fn decisions_made_at_once_each_see_the_others_requests() {
    // Rounds of four threads deciding for one new prompt at the same moment: the
    // first decision has nothing cached, and every later one finds the prompt
    // provisionally on the engine the earlier went to. Decisions that read the
    // scorer's state and record into it under separate locks would let two of
    // them both find nothing, and start the prefix twice.
    //
    // Each round's four decisions are made at one instant, and rounds a second
    // apart: on the wall clock, rounds less than `load_report_lag` apart (a fast
    // machine) pile each round's picks onto the next round's counts (this caller
    // never counts its requests in flight, nor ends them), until balancing the load
    // rightly outweighs a 64-token hit and a second engine starts the prefix.
    let scorer = KvScorer::new(Arc::new(KvIndex::new(IndexConfig::default())), weight(1));
    let c = cands(&[("a", 0), ("b", 0)]);
    let t0 = Instant::now();
    for round in 0..200u32 {
        let at = t0 + Duration::from_secs(u64::from(round));
        let prompt: Vec<u32> = (round * 1000..round * 1000 + 64).collect();
        let barrier = std::sync::Barrier::new(4);
        let cold = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        barrier.wait();
                        scorer.choose_at(&prompt, &c, at).unwrap().cached_tokens == 0
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|&cold| cold)
                .count()
        });
        assert_eq!(cold, 1, "round {round}: decisions that missed each other");
    }
}

#[test]
fn in_flight_counts_are_read_under_the_decision_lock() {
    // The caller's counts as read again once the lock is held win over the
    // snapshot in the candidates: b has 2 requests of 100 tokens in flight by the
    // re-read (96 + 200 > 256: a), none by the snapshot (96 < 256: b).
    let prompt: Vec<u32> = (0..256).collect();
    let index = index_with("b", &prompt[..160]);
    let scorer = KvScorer::new(index, weight(1));
    let now = Instant::now();
    for k in 1..=2u32 {
        let other: Vec<u32> = (k * 5000..k * 5000 + 100).collect();
        scorer.choose_at(&other, &cands(&[("b", 0)]), now);
    }
    let snapshot = cands(&[("a", 0), ("b", 0)]);
    let counts = [0, 2];
    let d = scorer.choose_with(&prompt, &snapshot, |i| counts[i], now);
    assert_eq!(d.unwrap().index, 0);
}

#[test]
fn a_miss_weight_keeps_a_request_with_its_prefix_longer() {
    let prompt: Vec<u32> = (0..256).collect();
    let index = index_with("b", &prompt[..160]);
    let now = Instant::now();
    index.loads().record(
        "b",
        0,
        crate::load::LoadStat {
            waiting: 1,
            waiting_uncached_tokens: 200,
            ..Default::default()
        },
        now,
    );
    let c = cands(&[("a", 0), ("b", 0)]);
    // Weight 1: b 96 + 200 = 296 > a 256. Weight 2: b 192 + 200 = 392 < a 512.
    let scorer = KvScorer::new(Arc::clone(&index), weight(1));
    assert_eq!(scorer.choose_at(&prompt, &c, now).unwrap().index, 0);
    let scorer = KvScorer::new(index, weight(2));
    assert_eq!(scorer.choose_at(&prompt, &c, now).unwrap().index, 1);
}

#[test]
fn provisional_entries_follow_a_burst() {
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let scorer = KvScorer::new(index, weight(1));
    let now = Instant::now();
    let prompt: Vec<u32> = (0..64).collect();
    let c = cands(&[("a", 0), ("b", 0)]);
    let first = scorer.choose_at(&prompt, &c, now).unwrap();
    assert_eq!((first.index, first.cached_tokens), (0, 0));
    // Same prompt again while the first is in flight on a: a holds it
    // provisionally (cost 0 + 64 queued) against b (64 + 0): the tie goes to the
    // cached prefix.
    let c = cands(&[("a", 1), ("b", 0)]);
    let second = scorer.choose_at(&prompt, &c, now).unwrap();
    assert_eq!((second.index, second.cached_tokens), (0, 64));
    assert_eq!(
        scorer.cached_tokens_at(&Candidate::new("a", 0), &prompt, now),
        64
    );
    // Once the entry expired, nothing is cached anywhere.
    let later = now + DEFAULT_PROVISIONAL_TTL + Duration::from_millis(1);
    assert_eq!(
        scorer.cached_tokens_at(&Candidate::new("a", 0), &prompt, later),
        0
    );
    // Forgotten: nothing queued on a by this scorer, whatever it is told.
    scorer.forget(&Candidate::new("a", 0));
    assert_eq!(scorer.queued_tokens(&Candidate::new("a", 2)), 0);
}

#[test]
fn provisional_entries_are_bounded() {
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let scorer = KvScorer::new(
        index,
        ScorerConfig {
            provisional_max_blocks: 8,
            ..ScorerConfig::default()
        },
    );
    let now = Instant::now();
    for i in 0..20u32 {
        let prompt: Vec<u32> = (i * 1000..i * 1000 + 64).collect();
        scorer.choose_at(&prompt, &cands(&[("a", 0)]), now);
        assert!(lock(&scorer.state).provisional.blocks <= 8);
    }
    let last: Vec<u32> = (19_000..19_064).collect();
    assert_eq!(
        scorer.cached_tokens_at(&Candidate::new("a", 0), &last, now),
        64
    );
    let first: Vec<u32> = (0..64).collect();
    assert_eq!(
        scorer.cached_tokens_at(&Candidate::new("a", 0), &first, now),
        0
    );
}

#[test]
fn rank_candidates_count_their_own_rank_only() {
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let prompt: Vec<u32> = (0..64).collect();
    let stored = BlockStored {
        block_hashes: (0..4).map(BlockHash::Int).collect(),
        token_ids: prompt.clone(),
        block_size: 16,
        ..BlockStored::default()
    };
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(stored)],
        dp_rank: Some(1),
    };
    index.apply("e", 1, &batch);
    let scorer = KvScorer::new(index, ScorerConfig::default());
    let ranks = [
        Candidate::new("e", 0).with_dp_rank(0),
        Candidate::new("e", 0).with_dp_rank(1),
    ];
    let d = scorer.choose(&prompt, &ranks).unwrap();
    assert_eq!((d.index, d.dp_rank, d.cached_tokens), (1, Some(1), 64));
    assert_eq!(scorer.cached_tokens(&ranks[0], &prompt), 0);
    // The whole engine: its best rank.
    let d = scorer.choose(&prompt, &[Candidate::new("e", 0)]).unwrap();
    assert_eq!((d.dp_rank, d.cached_tokens), (Some(1), 64));
}

#[test]
fn no_candidate_no_decision() {
    let scorer = KvScorer::new(
        Arc::new(KvIndex::new(IndexConfig::default())),
        ScorerConfig::default(),
    );
    assert!(scorer.choose(&[1, 2, 3], &[]).is_none());
}

#[test]
fn retain_keeps_the_history_of_the_given_candidates_only() {
    let scorer = KvScorer::new(Arc::new(KvIndex::new(IndexConfig::default())), weight(1));
    let now = Instant::now();
    let prompt: Vec<u32> = (0..64).collect();
    for i in 0..100 {
        let name = format!("http://10.0.0.{i}:8000");
        scorer
            .choose_at(&prompt, &cands(&[(&name, 0)]), now)
            .unwrap();
    }
    assert_eq!(scorer.known(), 100);
    let kept = ["http://10.0.0.3:8000", "http://10.0.0.7:8000"];
    scorer.retain(kept.iter().map(|e| Candidate::new(e, 0)));
    assert_eq!(scorer.known(), 2);
    // What was sent to a kept one is still counted queued there.
    assert!(scorer.queued_tokens(&Candidate::new(kept[0], 1)) > 0);
    assert_eq!(
        scorer.queued_tokens(&Candidate::new("http://10.0.0.4:8000", 1)),
        0
    );
}

fn remove(index: &KvIndex, engine: &str, blocks: std::ops::Range<u64>, dp_rank: u32) {
    let removed = crate::event::BlockRemoved {
        block_hashes: blocks
            .map(|b| BlockHash::Int(candidate_tag(engine, None) ^ b))
            .collect(),
        ..crate::event::BlockRemoved::default()
    };
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockRemoved(removed)],
        dp_rank: None,
    };
    index.apply(engine, dp_rank, &batch);
}

#[test]
fn an_engines_removal_drops_what_the_scorer_holds_provisionally_for_it() {
    let prompt: Vec<u32> = (0..64).collect();
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let scorer = KvScorer::new(Arc::clone(&index), ScorerConfig::default());
    // The scorer sends the prompt to a, then (a busy) to b: both hold it provisionally.
    let d = scorer
        .choose(&prompt, &cands(&[("a", 0), ("b", 0)]))
        .unwrap();
    assert_eq!(d.index, 0);
    let d = scorer
        .choose(&prompt, &cands(&[("a", 9), ("b", 0)]))
        .unwrap();
    assert_eq!(d.index, 1);
    let (a, b) = (Candidate::new("a", 0), Candidate::new("b", 0));
    assert_eq!(scorer.cached_tokens(&a, &prompt), 64);
    // a computes the prompt and says so, then evicts its last two blocks.
    store(&index, "a", &prompt);
    remove(&index, "a", 2..4, 0);
    // The index holds a's first two; its provisional entry no longer claims the rest,
    // and b's, which a's events say nothing about, is whole.
    assert_eq!(scorer.cached_tokens(&a, &prompt), 32);
    assert_eq!(scorer.cached_tokens(&b, &prompt), 64);
    // A pick reads the removals too: a evicted the rest, so it holds nothing, and
    // the idle c is as good (had a kept its provisional 64, a would win on them).
    remove(&index, "a", 0..2, 0);
    let d = scorer
        .choose(&prompt, &cands(&[("a", 0), ("c", 0)]))
        .unwrap();
    assert_eq!(d.cached_tokens, 0, "{d:?}");
    assert_eq!(scorer.cached_tokens(&a, &prompt), 0);
}

/// `engine`'s rank `rank` holds the first `blocks` blocks of `tokens` at `block_size`.
fn store_blocks(
    index: &KvIndex,
    engine: &str,
    rank: u32,
    tokens: &[u32],
    block_size: usize,
    blocks: usize,
) {
    let stored = BlockStored {
        block_hashes: (0..blocks as u64)
            .map(|b| BlockHash::Int(candidate_tag(engine, Some(rank)) ^ b))
            .collect(),
        token_ids: tokens[..blocks * block_size].to_vec(),
        block_size,
        ..BlockStored::default()
    };
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(stored)],
        dp_rank: Some(rank),
    };
    index.apply(engine, rank, &batch);
}

#[test]
fn cached_tokens_each_is_cached_tokens_of_each() {
    let prompt: Vec<u32> = (0..1_000).collect();
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    store_blocks(&index, "a", 0, &prompt, 16, 10);
    store_blocks(&index, "a", 1, &prompt, 16, 20);
    store_blocks(&index, "b", 0, &prompt, 16, 3);
    // An engine with other blocks, and a prefill engine that holds more than all.
    store_blocks(&index, "big", 0, &prompt, 32, 7);
    store_blocks(&index, "prefill", 0, &prompt, 16, 50);
    let scorer = KvScorer::new(Arc::clone(&index), ScorerConfig::default());
    let now = Instant::now();
    // Provisional entries: c (no events) for the whole prompt, b for a longer one.
    scorer.choose_at(&prompt, &cands(&[("c", 0)]), now);
    scorer.choose_at(&prompt[..400], &cands(&[("b", 0)]), now);
    scorer.choose_at(&prompt[..128], &cands(&[("big", 0)]), now);
    let candidates = [
        Candidate::new("a", 0),
        Candidate::new("a", 0).with_dp_rank(0),
        Candidate::new("a", 0).with_dp_rank(1),
        Candidate::new("a", 0).with_dp_rank(2),
        Candidate::new("b", 0),
        Candidate::new("big", 0),
        Candidate::new("c", 0),
        Candidate::new("d", 0),
    ];
    for tokens in [&prompt[..], &prompt[..300], &prompt[..10], &prompt[..0]] {
        let each = scorer.cached_tokens_each_at(&candidates, tokens, now);
        let one: Vec<usize> = candidates
            .iter()
            .map(|c| scorer.cached_tokens_at(c, tokens, now))
            .collect();
        assert_eq!(each, one, "{} tokens", tokens.len());
    }
    assert_eq!(
        scorer.cached_tokens_each_at(&candidates, &prompt, now),
        [320, 160, 320, 0, 400, 224, 992, 0]
    );
    assert!(scorer.cached_tokens_each(&[], &prompt).is_empty());
}

#[test]
fn cached_tokens_each_keys_the_prompt_once_not_per_candidate() {
    // A long prompt (4,096 blocks) and 64 candidates, two of which hold its first
    // blocks: the scorer keys the prompt as far as a candidate holds it, once, and
    // walks the index once (it keyed all 4,096 blocks per candidate: 262,144 keys).
    let prompt: Vec<u32> = (0..65_536).collect();
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    store_blocks(&index, "e7", 0, &prompt, 16, 40);
    let scorer = KvScorer::new(index, ScorerConfig::default());
    scorer.choose(&prompt[..16 * 100], &cands(&[("e9", 0)]));
    let names: Vec<String> = (0..64).map(|i| format!("e{i}")).collect();
    let candidates: Vec<Candidate<'_>> = names.iter().map(|n| Candidate::new(n, 0)).collect();
    let (keys, walks) = work::counts();
    let cached = scorer.cached_tokens_each(&candidates, &prompt);
    let (keys, walks) = (work::counts().0 - keys, work::counts().1 - walks);
    assert_eq!((cached[7], cached[9], cached[0]), (640, 1_600, 0));
    assert!(keys <= 101, "{keys} block keys");
    assert_eq!(walks, 1);
}
