//! The decoder against payloads encoded by the engines' own classes (see
//! `tests/fixtures/README.md`), and the index fed with them.

use disagg_kvevents::event::{BlockHash, BlockRemoved, BlockStored, KvEvent, decode_batch};
use disagg_kvevents::{IndexConfig, KvIndex};

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn ints(hashes: &[u64]) -> Vec<BlockHash> {
    hashes.iter().map(|&h| BlockHash::Int(h)).collect()
}

fn tokens(range: std::ops::RangeInclusive<u32>) -> Vec<u32> {
    range.collect()
}

/// The events of `vllm-0.33-map-int.msgpack` and `array-old.msgpack`.
fn vllm_events(group: Option<u32>) -> Vec<KvEvent> {
    vec![
        KvEvent::BlockStored(BlockStored {
            block_hashes: ints(&[0xF000_0000_0000_0001, 2]),
            parent_block_hash: None,
            token_ids: tokens(1..=32),
            block_size: 16,
            medium: Some("GPU".into()),
            group_idx: group,
            namespaced: false,
            first_keyed_block: None,
        }),
        KvEvent::BlockStored(BlockStored {
            block_hashes: ints(&[3]),
            parent_block_hash: Some(BlockHash::Int(2)),
            token_ids: tokens(33..=48),
            block_size: 16,
            medium: Some("GPU".into()),
            group_idx: group,
            namespaced: false,
            first_keyed_block: None,
        }),
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: ints(&[3]),
            medium: Some("GPU".into()),
            group_idx: group,
        }),
        KvEvent::AllBlocksCleared,
    ]
}

/// Applies `events` one at a time to a fresh index and returns the tokens of 1..=64
/// that engine "e" holds after each.
fn held_after_each(events: &[KvEvent]) -> Vec<usize> {
    let index = KvIndex::new(IndexConfig::default());
    let prompt = tokens(1..=64);
    events
        .iter()
        .map(|event| {
            let batch = disagg_kvevents::EventBatch {
                ts: 0.0,
                events: vec![event.clone()],
                dp_rank: None,
            };
            index.apply("e", 0, &batch);
            index.cached_tokens("e", &prompt)
        })
        .collect()
}

#[test]
fn vllm_map_tagged_integer_hashes() {
    let batch = decode_batch(&fixture("vllm-0.33-map-int.msgpack")).unwrap();
    assert_eq!(batch.ts, 1_700_000_000.25);
    assert_eq!(batch.dp_rank, Some(0));
    assert_eq!(batch.events, vllm_events(Some(0)));
    assert_eq!(held_after_each(&batch.events), vec![32, 48, 32, 0]);
}

#[test]
fn vllm_map_tagged_byte_hashes() {
    let batch = decode_batch(&fixture("vllm-0.33-map-bytes.msgpack")).unwrap();
    assert_eq!(batch.dp_rank, Some(2));
    assert_eq!(batch.events.len(), 3);
    let KvEvent::BlockStored(first) = &batch.events[0] else {
        panic!("{:?}", batch.events[0]);
    };
    assert!(
        first
            .block_hashes
            .iter()
            .all(|h| matches!(h, BlockHash::Bytes(b) if b.len() == 32))
    );
    let KvEvent::BlockStored(second) = &batch.events[1] else {
        panic!("{:?}", batch.events[1]);
    };
    // The parent is the first event's second hash, byte for byte.
    assert_eq!(second.parent_block_hash.as_ref(), first.block_hashes.get(1));
    // The removal names the third block by its bytes.
    assert_eq!(held_after_each(&batch.events), vec![32, 48, 32]);
}

#[test]
fn newer_fields_unknown_events_and_batch_fields_are_tolerated() {
    let batch = decode_batch(&fixture("vllm-0.33-map-unknown.msgpack")).unwrap();
    assert_eq!(batch.dp_rank, Some(0));
    assert_eq!(batch.events.len(), 3);
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("{:?}", batch.events[0]);
    };
    assert_eq!(stored.token_ids, tokens(100..=115));
    // `extra_keys` of nil entries keys nothing beyond the tokens.
    assert_eq!(stored.first_keyed_block, None);
    assert!(!stored.namespaced);
    assert_eq!(batch.events[1], KvEvent::Unknown("BlockPinned".into()));
    assert_eq!(
        batch.events[2],
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: ints(&[10]),
            medium: Some("CPU".into()),
            group_idx: Some(0),
        })
    );
    let index = KvIndex::new(IndexConfig::default());
    let applied = index.apply("e", 0, &batch);
    assert_eq!(
        (applied.stored, applied.unknown, applied.removed),
        (1, 1, 0)
    );
    // Removed from the CPU tier only: still on the GPU.
    assert_eq!(index.cached_tokens("e", &tokens(100..=131)), 16);
}

#[test]
fn older_array_tagged_events() {
    let batch = decode_batch(&fixture("array-old.msgpack")).unwrap();
    assert_eq!(batch.ts, 1_700_000_003.0);
    assert_eq!(batch.dp_rank, None);
    assert_eq!(batch.events, vllm_events(None));
    assert_eq!(held_after_each(&batch.events), vec![32, 48, 32, 0]);
}

#[test]
fn sglang_signed_hashes() {
    let batch = decode_batch(&fixture("sglang-0.5.23-map.msgpack")).unwrap();
    assert_eq!(batch.dp_rank, Some(1));
    let KvEvent::BlockStored(first) = &batch.events[0] else {
        panic!("{:?}", batch.events[0]);
    };
    assert_eq!(
        first.block_hashes,
        ints(&[(-5i64) as u64, (-(1i64 << 62)) as u64])
    );
    let KvEvent::BlockStored(second) = &batch.events[1] else {
        panic!("{:?}", batch.events[1]);
    };
    assert_eq!(
        second.parent_block_hash,
        Some(BlockHash::Int((-(1i64 << 62)) as u64))
    );
    // Evicting the middle block breaks the chain after the first.
    assert_eq!(held_after_each(&batch.events), vec![32, 48, 16, 0]);
}

/// A load report as SGLang's own `LoadStat` encodes it.
#[test]
fn sglang_load_stat() {
    let stat = disagg_kvevents::load::decode_load(&fixture("sglang-0.5.23-load.msgpack")).unwrap();
    assert_eq!(
        stat,
        disagg_kvevents::LoadStat {
            running: 3,
            waiting: 5,
            kv_tokens: 1000,
            kv_capacity: 8000,
            waiting_uncached_tokens: 4096,
        }
    );
}
