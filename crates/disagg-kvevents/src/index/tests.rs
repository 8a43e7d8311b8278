//! Unit tests of `index`.

use super::*;
use crate::event::BlockHash;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
        parent_block_hash: parent.map(BlockHash::Int),
        token_ids: tokens.to_vec(),
        block_size: 4,
        ..BlockStored::default()
    })
}

fn removed(hashes: &[u64], medium: Option<&str>) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
        medium: medium.map(str::to_owned),
        group_idx: None,
    })
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        ts: 0.0,
        events,
        dp_rank: None,
    }
}

fn prompt() -> Vec<u32> {
    (100..124).collect() // 6 blocks of 4
}

#[test]
fn stored_chains_are_matched_per_engine_and_rank() {
    let index = KvIndex::new(IndexConfig::default());
    let p = prompt();
    index.apply("a", 0, &batch(vec![stored(&[1, 2], None, &p[..8])]));
    index.apply("a", 0, &batch(vec![stored(&[3], Some(2), &p[8..12])]));
    index.apply("a", 1, &batch(vec![stored(&[1], None, &p[..4])]));
    index.apply("b", 0, &batch(vec![stored(&[9, 8], None, &p[..8])]));
    let m = index.match_prefix(&p);
    assert_eq!(m.engine("a").map(|m| (m.blocks, m.dp_rank)), Some((3, 0)));
    assert_eq!(m.engine("b").map(|m| m.blocks), Some(2));
    assert_eq!(m.holders().len(), 3);
    assert_eq!(m.best().map(|m| &*m.engine), Some("a"));
    assert_eq!(index.cached_tokens("a", &p), 12);
    assert_eq!(index.cached_tokens("b", &p), 8);
    assert_eq!(index.cached_tokens("c", &p), 0);
    // Another prompt sharing the first block only.
    let mut other = p;
    other[5] = 7;
    assert_eq!(index.cached_tokens("a", &other), 4);
}

#[test]
fn removal_and_clear_take_blocks_away() {
    let index = KvIndex::new(IndexConfig::default());
    let p = prompt();
    index.apply("a", 0, &batch(vec![stored(&[1, 2, 3], None, &p[..12])]));
    index.apply("a", 0, &batch(vec![removed(&[3], None)]));
    assert_eq!(index.cached_tokens("a", &p), 8);
    // Evicting a middle block breaks the chain there.
    index.apply("a", 0, &batch(vec![removed(&[1], Some("GPU"))]));
    assert_eq!(index.cached_tokens("a", &p), 0);
    index.apply("a", 0, &batch(vec![stored(&[1], None, &p[..4])]));
    assert_eq!(index.cached_tokens("a", &p), 8);
    index.apply("a", 0, &batch(vec![KvEvent::AllBlocksCleared]));
    assert_eq!(index.cached_tokens("a", &p), 0);
    assert_eq!(index.stats().keys, 0);
}

#[test]
fn a_block_offloaded_to_cpu_stays_until_every_medium_dropped_it() {
    let index = KvIndex::new(IndexConfig::default());
    let p = prompt();
    index.apply("a", 0, &batch(vec![stored(&[1], None, &p[..4])]));
    let mut cpu = stored(&[1], None, &p[..4]);
    if let KvEvent::BlockStored(s) = &mut cpu {
        s.medium = Some("CPU".into());
    }
    index.apply("a", 0, &batch(vec![cpu, removed(&[1], Some("GPU"))]));
    assert_eq!(index.cached_tokens("a", &p), 4);
    index.apply("a", 0, &batch(vec![removed(&[1], Some("CPU"))]));
    assert_eq!(index.cached_tokens("a", &p), 0);
}

#[test]
fn unkeyable_blocks_are_skipped() {
    let index = KvIndex::new(IndexConfig::default());
    let p = prompt();
    let mut lora = stored(&[1], None, &p[..4]);
    if let KvEvent::BlockStored(s) = &mut lora {
        s.namespaced = true;
    }
    let mut mm = stored(&[1, 2], None, &p[..8]);
    if let KvEvent::BlockStored(s) = &mut mm {
        s.first_keyed_block = Some(1);
    }
    let orphan = stored(&[7], Some(99), &p[4..8]);
    let applied = index.apply("a", 0, &batch(vec![lora, mm, orphan]));
    assert_eq!(applied.stored, 1);
    assert_eq!(applied.skipped, 3);
    assert_eq!(index.cached_tokens("a", &p), 4);
    // Another block size than the holder's first is skipped too.
    let mut big = stored(&[5], None, &p[..8]);
    if let KvEvent::BlockStored(s) = &mut big {
        s.block_size = 8;
    }
    assert_eq!(index.apply("a", 0, &batch(vec![big])).skipped, 1);
    assert_eq!(index.block_size("a"), Some(4));
}

/// `stored` with `block_size` tokens per block.
fn stored_sized(hashes: &[u64], tokens: &[u32], block_size: usize) -> KvEvent {
    let mut e = stored(hashes, None, tokens);
    if let KvEvent::BlockStored(s) = &mut e {
        s.block_size = block_size;
    }
    e
}

/// An engine restarted with another `--block-size`: the restart (or the engine's own
/// `AllBlocksCleared`) clears its holder, and the new size is taken from its next
/// `BlockStored`. Before, the first size was kept through the clear and every later
/// block skipped for good.
#[test]
fn a_reset_holder_takes_the_block_size_of_its_next_blocks() {
    let index = KvIndex::new(IndexConfig::default());
    let p: Vec<u32> = (100..164).collect(); // 2 blocks of 32, 4 of 16
    index.apply("a", 0, &batch(vec![stored_sized(&[1], &p[..32], 32)]));
    assert_eq!(index.cached_tokens("a", &p), 32);
    assert_eq!(index.block_size("a"), Some(32));
    // Lost events (a gap): the blocks go, the size stays.
    index.clear("a", 0);
    assert_eq!(index.block_size("a"), Some(32));
    // A restart detected by the subscriber: the size goes too.
    index.reset("a", 0);
    assert_eq!(index.block_size("a"), None);
    let applied = index.apply("a", 0, &batch(vec![stored_sized(&[2, 3], &p[..32], 16)]));
    assert_eq!((applied.stored, applied.skipped), (2, 0));
    assert_eq!(index.cached_tokens("a", &p), 32);
    assert_eq!(index.block_size("a"), Some(16));
    // The engine's own AllBlocksCleared (a cache reset, same process) keeps the size: a
    // block of another size after it (a hybrid model's partial block) is skipped.
    let applied = index.apply(
        "a",
        0,
        &batch(vec![
            KvEvent::AllBlocksCleared,
            stored_sized(&[4, 5, 6, 7], &p[..32], 8),
        ]),
    );
    assert_eq!((applied.stored, applied.skipped), (0, 4));
    assert_eq!(index.block_size("a"), Some(16));
}

#[test]
fn a_block_size_out_of_range_is_skipped_not_a_panic() {
    // A holder's first BlockStored naming 2^63 tokens per block (a caller that
    // built it; the decoder refuses it): n * block_size overflowed, then sliced.
    let index = KvIndex::new(IndexConfig::default());
    let p = prompt();
    for size in [1usize << 63, 0] {
        let mut huge = stored(&[1, 2], None, &p[..8]);
        if let KvEvent::BlockStored(s) = &mut huge {
            s.block_size = size;
        }
        assert_eq!(index.apply("a", 0, &batch(vec![huge])).skipped, 2);
    }
    assert_eq!(index.block_size("a"), None);
    index.apply("a", 0, &batch(vec![stored(&[1], None, &p[..4])]));
    assert_eq!(index.cached_tokens("a", &p), 4);
}

#[test]
fn removing_an_engine_frees_its_slot_for_another() {
    let index = KvIndex::new(IndexConfig::default());
    let p = prompt();
    index.apply("a", 0, &batch(vec![stored(&[1, 2], None, &p[..8])]));
    index.remove_engine("a");
    assert_eq!(index.cached_tokens("a", &p), 0);
    assert!(index.engines().is_empty());
    assert_eq!(index.stats(), IndexStats::default());
    index.apply("b", 0, &batch(vec![stored(&[1], None, &p[..4])]));
    let m = index.match_prefix(&p);
    assert_eq!(m.holders().len(), 1);
    assert_eq!(m.engine("b").map(|m| m.blocks), Some(1));
    assert_eq!(index.engines(), vec!["b".to_owned()]);
}

#[test]
fn entry_sizes_are_the_documented_ones() {
    // The module docs' memory figures rest on these.
    eprintln!(
        "key entry {} bytes, holder entry {} bytes",
        std::mem::size_of::<(u64, HolderSet)>(),
        std::mem::size_of::<(u64, Block)>()
    );
    assert!(std::mem::size_of::<(u64, HolderSet)>() <= 40);
    assert!(std::mem::size_of::<(u64, Block)>() <= 24);
}

#[test]
fn holder_sets_turn_into_bits_and_back_to_empty() {
    let mut set = HolderSet::default();
    for slot in [3, 1, 200, 64, 3, 7] {
        set.insert(slot);
    }
    assert!(matches!(set, HolderSet::Many(_)));
    for slot in [1, 3, 7, 64, 200] {
        assert!(set.contains(slot));
    }
    assert!(!set.contains(2) && !set.contains(1000));
    for slot in [1, 3, 7, 64] {
        assert!(!set.remove(slot));
    }
    assert!(set.remove(200));
    let bits = Bits(vec![0b1010, 0, 1]);
    assert_eq!(bits.slots().collect::<Vec<_>>(), vec![1, 3, 128]);
}

#[test]
fn many_holders_match_like_few() {
    // 70 engines hold the first two blocks, every tenth the third, one the fourth.
    let index = KvIndex::new(IndexConfig::default());
    let p = prompt();
    for e in 0..70u64 {
        let name = format!("e{e}");
        let blocks = match e {
            0 => 4,
            e if e % 10 == 0 => 3,
            _ => 2,
        };
        let hashes: Vec<u64> = (0..blocks).map(|b| e * 100 + b).collect();
        index.apply(
            &name,
            0,
            &batch(vec![stored(&hashes, None, &p[..blocks as usize * 4])]),
        );
    }
    let m = index.match_prefix(&p);
    assert_eq!(m.holders().len(), 70);
    for e in 0..70 {
        let want = match e {
            0 => 4,
            e if e % 10 == 0 => 3,
            _ => 2,
        };
        assert_eq!(
            m.engine(&format!("e{e}")).map(|m| m.blocks),
            Some(want),
            "e{e}"
        );
    }
    assert_eq!(index.cached_tokens("e30", &p), 12);
    index.remove_engine("e0");
    assert_eq!(index.match_prefix(&p).best().map(|m| m.blocks), Some(3));
}

#[test]
fn memory_is_bounded_per_holder() {
    let index = KvIndex::new(IndexConfig {
        block_size: 4,
        max_blocks_per_holder: 8,
    });
    for i in 0..100u32 {
        let tokens = [i, i, i, i];
        index.apply(
            "a",
            0,
            &batch(vec![stored(&[u64::from(i) + 1], None, &tokens)]),
        );
        assert!(index.stats().blocks <= 8);
    }
    // The most recent blocks are still there.
    assert_eq!(index.cached_tokens("a", &[99, 99, 99, 99]), 4);
    assert_eq!(index.cached_tokens("a", &[0, 0, 0, 0]), 0);
    assert_eq!(index.stats().keys, index.stats().blocks);
}
