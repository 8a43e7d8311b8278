//! Unit tests of `event`.

use proptest::prelude::*;
use rmpv::Value;

use super::*;

#[test]
fn frames_need_three_and_an_eight_byte_seq() {
    let seq = 7u64.to_be_bytes();
    let f = split_frames(&[b"t", &seq, b"p"]).unwrap();
    assert_eq!((f.topic, f.seq, f.payload), (&b"t"[..], 7, &b"p"[..]));
    assert!(matches!(
        split_frames(&[b"t", b"1234", b"p"]),
        Err(DecodeError::Frames {
            frames: 3,
            seq_len: 4
        })
    ));
    assert!(split_frames(&[b"t", &seq]).is_err());
}

#[test]
fn malformed_known_event_fails_the_batch() {
    let bad = Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![Value::Map(vec![
            ("type".into(), "BlockStored".into()),
            ("block_hashes".into(), Value::Array(vec![1.into()])),
            ("token_ids".into(), Value::Array(vec![(-1).into()])),
            ("block_size".into(), 16.into()),
        ])]),
    ]);
    assert_eq!(
        decode_batch(&encode(&bad)),
        Err(DecodeError::Field {
            event: "BlockStored",
            field: "token_ids"
        })
    );
    assert!(matches!(
        decode_batch(&[0x93, 0xcb, 0x3f]),
        Err(DecodeError::Msgpack(_))
    ));
    assert_eq!(
        decode_batch(&encode(&Value::from(3))),
        Err(DecodeError::Batch)
    );
    let untagged = Value::Array(vec![Value::F64(1.0), Value::Array(vec![Value::from(5)])]);
    assert_eq!(decode_batch(&encode(&untagged)), Err(DecodeError::Untagged));
}

/// A batch encoded as a map (a msgspec struct without `array_like`) is read by its
/// keys, in any order, unknown ones skipped; before, only the array was accepted.
#[test]
fn a_batch_as_a_map_is_read_by_its_keys() {
    let stored = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), Value::Array(vec![5.into()])),
        (
            "token_ids".into(),
            Value::Array((1..=4).map(Value::from).collect()),
        ),
        ("block_size".into(), 4.into()),
    ]);
    let cleared = Value::Map(vec![("type".into(), "AllBlocksCleared".into())]);
    let map = Value::Map(vec![
        ("events".into(), Value::Array(vec![stored, cleared])),
        ("future_field".into(), Value::Array(vec![Value::Nil])),
        ("ts".into(), Value::F64(2.5)),
        ("data_parallel_rank".into(), 3.into()),
    ]);
    let batch = decode_batch(&encode(&map)).unwrap();
    assert_eq!((batch.ts, batch.dp_rank), (2.5, Some(3)));
    assert_eq!(batch.events.len(), 2);
    assert!(matches!(&batch.events[0], KvEvent::BlockStored(s) if s.token_ids == [1, 2, 3, 4]));
    assert_eq!(batch.events[1], KvEvent::AllBlocksCleared);
    // SGLang's name for the rank, an integer timestamp; or no rank at all.
    let sglang = Value::Map(vec![
        ("ts".into(), 7.into()),
        ("events".into(), Value::Array(vec![])),
        ("attn_dp_rank".into(), 1.into()),
    ]);
    let batch = decode_batch(&encode(&sglang)).unwrap();
    assert_eq!(
        (batch.ts, batch.dp_rank, batch.events.len()),
        (7.0, Some(1), 0)
    );
    let bare = Value::Map(vec![
        ("ts".into(), Value::F64(1.0)),
        ("events".into(), Value::Array(vec![])),
    ]);
    assert_eq!(decode_batch(&encode(&bare)).unwrap().dp_rank, None);
    // Without its timestamp or its events, or with them of the wrong type: not a batch.
    for fields in [
        vec![("ts", Value::F64(1.0))],
        vec![("events", Value::Array(vec![]))],
        vec![("ts", "t".into()), ("events", Value::Array(vec![]))],
        vec![("ts", Value::F64(1.0)), ("events", 3.into())],
    ] {
        let map = Value::Map(fields.into_iter().map(|(k, v)| (k.into(), v)).collect());
        assert_eq!(
            decode_batch(&encode(&map)),
            Err(DecodeError::Batch),
            "{map}"
        );
    }
    // A malformed event fails it as in the array form.
    let bad = Value::Map(vec![
        ("ts".into(), Value::F64(1.0)),
        ("events".into(), Value::Array(vec![Value::from(5)])),
    ]);
    assert_eq!(decode_batch(&encode(&bad)), Err(DecodeError::Untagged));
}

#[test]
fn numbers_out_of_range_fail_the_event_not_the_process() {
    // A block size of 2^63 (and 0) is refused at decoding: the index multiplies it.
    for block_size in [
        Value::from(1u64 << 63),
        Value::from(0),
        Value::from((MAX_BLOCK_SIZE + 1) as u64),
    ] {
        let stored = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Map(vec![
                ("type".into(), "BlockStored".into()),
                (
                    "block_hashes".into(),
                    Value::Array(vec![1.into(), 2.into()]),
                ),
                ("token_ids".into(), Value::Array(vec![1.into(); 4])),
                ("block_size".into(), block_size),
            ])]),
        ]);
        assert_eq!(
            decode_batch(&encode(&stored)),
            Err(DecodeError::Field {
                event: "BlockStored",
                field: "block_size"
            })
        );
    }
}

/// `[ts, [0] * n]` as an engine-like publisher would send it, built without an
/// intermediate value.
fn zeros_batch(n: u32) -> Vec<u8> {
    let mut out = vec![0x92, 0xcb];
    out.extend_from_slice(&1.0f64.to_be_bytes());
    out.push(0xdd);
    out.extend_from_slice(&n.to_be_bytes());
    out.resize(out.len() + n as usize, 0);
    out
}

#[test]
fn counts_and_decoded_memory_have_ceilings() {
    // 24 MB of one-byte "events": more than the default 65,536 events, refused
    // before any is read; fewer, refused at the first (not an event).
    assert_eq!(
        decode_batch(&zeros_batch(24_000_000)),
        Err(DecodeError::Limit { what: "events" })
    );
    assert_eq!(decode_batch(&zeros_batch(1000)), Err(DecodeError::Untagged));
    // More events than the limit: refused before any is read.
    let limits = DecodeLimits {
        max_events: 10,
        ..DecodeLimits::default()
    };
    assert_eq!(
        decode_batch_with(&zeros_batch(11), &limits),
        Err(DecodeError::Limit { what: "events" })
    );
    // One event of 4 M one-byte hashes: 4 MB on the wire, 128 MB as `BlockHash`es,
    // over the decoded bytes' ceiling of four times the message size.
    let n = 4_000_000u32;
    let mut payload = vec![0x92, 0x01, 0x91, 0x92, 0xac];
    payload.extend_from_slice(b"BlockRemoved");
    payload.push(0xdd);
    payload.extend_from_slice(&n.to_be_bytes());
    payload.resize(payload.len() + n as usize, 7);
    let limits = DecodeLimits::for_message(payload.len());
    assert_eq!(
        decode_batch_with(&payload, &limits),
        Err(DecodeError::Limit {
            what: "decoded bytes"
        })
    );
    // Within a large enough budget it decodes.
    let roomy = DecodeLimits {
        max_decoded_bytes: 200 << 20,
        ..limits
    };
    let batch = decode_batch_with(&payload, &roomy).unwrap();
    assert!(
        matches!(&batch.events[0], KvEvent::BlockRemoved(r) if r.block_hashes.len() == n as usize)
    );
    // Items per event.
    let few = DecodeLimits {
        max_items: 100,
        ..roomy
    };
    assert_eq!(
        decode_batch_with(&payload, &few),
        Err(DecodeError::Limit { what: "items" })
    );
}

/// `[1, [["BlockRemoved", [b"\x07"] * n]]]`: `n` one-byte binary hashes, 3 bytes each
/// on the wire.
fn one_byte_bins_removed(n: u32) -> Vec<u8> {
    let mut payload = vec![0x92, 0x01, 0x91, 0x92, 0xac];
    payload.extend_from_slice(b"BlockRemoved");
    payload.push(0xdd);
    payload.extend_from_slice(&n.to_be_bytes());
    for _ in 0..n {
        payload.extend_from_slice(&[0xc4, 0x01, 0x07]);
    }
    payload
}

#[test]
fn a_byte_hash_is_charged_the_allocation_it_holds() {
    // 1 M one-byte binary hashes: 3 MB on the wire; 24 MB of `BlockHash`es plus, for
    // each, its own one-byte `Vec`, which holds a 32-byte allocator chunk: 56 MB held.
    // Charging the byte alone (25 MB) let it through a ceiling of 48 MB.
    let n = 1_000_000;
    let payload = one_byte_bins_removed(n);
    let held = n as usize * (std::mem::size_of::<BlockHash>() + 32);
    let between = DecodeLimits {
        max_decoded_bytes: 48_000_000,
        ..DecodeLimits::for_message(payload.len())
    };
    assert!(n as usize * (std::mem::size_of::<BlockHash>() + 1) < between.max_decoded_bytes);
    assert!(held > between.max_decoded_bytes);
    // (Not `assert_eq!`: a batch decoded would print its million hashes.)
    let decoded = decode_batch_with(&payload, &between);
    assert!(
        decoded
            == Err(DecodeError::Limit {
                what: "decoded bytes"
            }),
        "{:?}",
        decoded.map(|batch| batch.events.len())
    );
    // With room for what it holds, it decodes.
    let roomy = DecodeLimits {
        max_decoded_bytes: held + (1 << 20),
        ..between
    };
    let batch = decode_batch_with(&payload, &roomy).unwrap();
    assert!(matches!(
        &batch.events[0],
        KvEvent::BlockRemoved(r) if r.block_hashes.len() == n as usize
            && r.block_hashes[0] == BlockHash::Bytes(vec![7])
    ));
}

#[test]
fn heap_charges_are_allocator_chunks() {
    assert_eq!(heap_bytes(0), 0);
    for (bytes, chunk) in [(1, 32), (24, 32), (25, 48), (32, 48), (40, 48), (41, 64)] {
        assert_eq!(heap_bytes(bytes), chunk, "{bytes}");
    }
    assert_eq!(heap_bytes(usize::MAX), usize::MAX & !15);
}

/// `[1.0, [{"type": "BlockStored", block_hashes, token_ids, "block_size": 1,
/// "k0": 0, .. "k{unknown-1}": 0, "block_size": 2}]]`: the known fields, `unknown`
/// distinct unknown keys, then a repeated `block_size`.
fn stored_with_unknown_keys(unknown: usize) -> Vec<u8> {
    let mut entries: Vec<(Value, Value)> = vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), Value::Array(vec![7.into()])),
        ("token_ids".into(), Value::Array(vec![1.into()])),
        ("block_size".into(), 1.into()),
    ];
    entries.extend((0..unknown).map(|i| (Value::from(format!("k{i}")), Value::from(0))));
    entries.push(("block_size".into(), 2.into()));
    let batch = Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![Value::Map(entries)]),
    ]);
    encode(&batch)
}

#[test]
fn an_event_map_past_the_field_ceiling_is_refused_before_its_walk() {
    // At the ceiling (the four known entries, the repeat and 251 unknown keys): the
    // unknown keys skipped, the first `block_size` read.
    let at = stored_with_unknown_keys(MAX_EVENT_FIELDS - 5);
    let batch = decode_batch(&at).unwrap();
    let [KvEvent::BlockStored(stored)] = &batch.events[..] else {
        panic!("{batch:?}")
    };
    assert_eq!(
        (stored.block_hashes.clone(), stored.block_size),
        (vec![BlockHash::Int(7)], 1)
    );
    // One more entry, or 200,000 distinct keys (a 1.7 MB message, whose walk was
    // quadratic in them): refused at the map's header.
    for unknown in [MAX_EVENT_FIELDS - 4, 200_000] {
        assert_eq!(
            decode_batch(&stored_with_unknown_keys(unknown)),
            Err(DecodeError::Limit { what: "fields" }),
            "{unknown}"
        );
    }
}

/// Values shaped like event fields: mostly the right type, sometimes not.
fn field_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Nil),
        any::<u64>().prop_map(Value::from),
        (-5i64..5).prop_map(Value::from),
        (0u64..40).prop_map(Value::from),
        proptest::collection::vec(
            prop_oneof![
                any::<u64>().prop_map(Value::from),
                (0u64..300).prop_map(Value::from),
                (-3i64..0).prop_map(Value::from),
                proptest::collection::vec(any::<u8>(), 0..4).prop_map(Value::from),
                Just(Value::Nil),
                Just(Value::from("x"))
            ],
            0..6
        )
        .prop_map(Value::Array),
        prop_oneof![Just("GPU"), Just("CPU"), Just("")].prop_map(Value::from),
        proptest::collection::vec(any::<u8>(), 0..6).prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        Just(Value::Map(vec![(
            "k".into(),
            Value::Array(vec![Value::Nil])
        )])),
    ]
}

fn event_value() -> impl Strategy<Value = Value> {
    let names = prop_oneof![
        Just("block_hashes"),
        Just("parent_block_hash"),
        Just("token_ids"),
        Just("block_size"),
        Just("lora_id"),
        Just("medium"),
        Just("lora_name"),
        Just("cache_salt"),
        Just("extra_keys"),
        Just("group_idx"),
        Just("type"),
        Just("other"),
    ];
    let tag = prop_oneof![
        Just("BlockStored"),
        Just("BlockRemoved"),
        Just("AllBlocksCleared"),
        Just("Newer"),
    ];
    prop_oneof![
        (
            tag.clone(),
            proptest::collection::vec((names, field_value()), 0..10),
            any::<bool>()
        )
            .prop_map(|(tag, fields, tag_last)| {
                let mut entries: Vec<(Value, Value)> = fields
                    .into_iter()
                    .map(|(k, v)| (Value::from(k), v))
                    .collect();
                let t = (Value::from("type"), Value::from(tag));
                if tag_last {
                    entries.push(t)
                } else {
                    entries.insert(0, t)
                }
                Value::Map(entries)
            }),
        (tag, proptest::collection::vec(field_value(), 0..9)).prop_map(|(tag, mut values)| {
            values.insert(0, Value::from(tag));
            Value::Array(values)
        }),
        field_value(),
    ]
}

proptest! {
    #[test]
    fn decodes_as_the_rmpv_decoder_did(
        ts in prop_oneof![any::<f64>().prop_map(Value::from), any::<i64>().prop_map(Value::from), Just(Value::from("t"))],
        events in proptest::collection::vec(event_value(), 0..4),
        rank in prop_oneof![Just(None), any::<u64>().prop_map(|r| Some(Value::from(r))), Just(Some(Value::Nil))],
    ) {
        let mut batch = vec![ts, Value::Array(events)];
        batch.extend(rank);
        let payload = encode(&Value::Array(batch));
        let new = decode_batch(&payload);
        let old = reference::decode_batch(&payload);
        match (&new, &old) {
            (Ok(a), Ok(b)) => {
                // NaN timestamps compare unequal: compare their bits.
                prop_assert_eq!(a.ts.to_bits(), b.ts.to_bits());
                prop_assert_eq!(&a.events, &b.events);
                prop_assert_eq!(a.dp_rank, b.dp_rank);
            }
            (Err(_), Err(_)) => {}
            _ => prop_assert!(false, "bounded {:?} vs rmpv {:?}", new, old),
        }
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
        let _ = decode_batch(&bytes);
        let _ = crate::load::decode_load(&bytes);
    }
}
