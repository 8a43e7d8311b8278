//! What a page of pods decodes into: discovery's [`EnginePod`] keeps the few fields it
//! reads and skips the rest of each pod as it is read, where k8s-openapi's `Pod` decodes
//! it whole (an empty `{"name":""}` volume into a `Volume` of about 3.2 KB, a
//! `managedFields[].fieldsV1` into a `serde_json::Value` tree).
//!
//! Every allocation of this test binary goes through a counting global allocator
//! (`cap`'s: a `#[global_allocator]` static of a crate's type, which needs no `unsafe`
//! here), so what a decoding still holds is counted to the byte: the bytes allocated and
//! not yet freed after it, its result held, less those before. `cargo test` runs a
//! binary's tests on threads of one process, so each test measures holding [`ALONE`].
//!
//! The `#[ignore]`d tests measure the worst cases the client's bounds leave (the figures
//! in `src/kubernetes/bounds.rs`); each builds a 64 MiB page or event and takes up to
//! about 0.6 GB: `cargo nextest run -p disagg-discovery --all-features --test pod_memory
//! --run-ignored ignored-only --no-capture` prints them (nextest runs each test in its own
//! process, as the peaks need; `cargo test` would run them in one).

use std::alloc::System;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::mem::size_of;
use std::sync::{Mutex, MutexGuard, PoisonError};

use cap::Cap;
use disagg_discovery::kubernetes::{
    EngineContainer, EngineContainerPort, EnginePod, EnginePodCondition,
};
use k8s_openapi::api::core::v1::Pod;
use kube::core::{ObjectList, WatchEvent};
use serde_json::{Value, json};

/// Every allocation of the test binary, counted.
#[global_allocator]
static HEAP: Cap<System> = Cap::new(System, usize::MAX);

/// Held by each test while it measures, so that no other test allocates meanwhile.
static ALONE: Mutex<()> = Mutex::new(());

fn alone() -> MutexGuard<'static, ()> {
    ALONE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What `make` returns, and the bytes it left allocated (those its result holds).
fn held<T>(make: impl FnOnce() -> T) -> (T, usize) {
    let before = HEAP.allocated();
    let value = make();
    (value, HEAP.allocated().saturating_sub(before))
}

/// What `make` returns, the bytes it allocated in all (freed or not), and the most bytes
/// allocated beyond those before while it ran, if that is known: the allocator keeps
/// only the process's highest mark, so a peak below an earlier one is not.
fn during<T>(make: impl FnOnce() -> T) -> (T, usize, Option<usize>) {
    let before = (
        HEAP.allocated(),
        HEAP.total_allocated(),
        HEAP.max_allocated(),
    );
    let value = make();
    let (total, highest) = (HEAP.total_allocated(), HEAP.max_allocated());
    let peak = (highest > before.2).then(|| highest - before.0);
    (value, total - before.1, peak)
}

/// A peak, as printed.
fn shown(peak: Option<usize>) -> String {
    peak.map_or("under an earlier one (run the test alone)".into(), mb)
}

/// This process's resident memory (`VmRSS` of `/proc/self/status`), where there is one:
/// what the counted bytes take from the system, the allocator's rounding included.
fn resident() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// `bytes` in MB (or bytes, under one), for the figures printed.
fn mb(bytes: usize) -> String {
    if bytes < 1_000_000 {
        format!("{bytes} bytes")
    } else {
        format!("{:.1} MB", bytes as f64 / 1e6)
    }
}

/// Pods in the page.
const PODS: usize = 8;
/// Empty volumes in each pod's spec.
const VOLUMES: usize = 2_000;
/// Members of each pod's `fieldsV1` (as wide as it is), besides a chain 100 deep.
const FIELDS: usize = 4_000;

/// Pod `i`: the fields discovery reads, and large parts it does not (empty volumes,
/// environment variables, owner references, a wide and deep `managedFields`).
fn pod(i: usize) -> Value {
    let mut deep = json!({});
    for _ in 0..100 {
        deep = json!({ "f:a": deep });
    }
    let mut fields = serde_json::Map::new();
    for f in 0..FIELDS {
        fields.insert(format!("f:k{f}"), json!({}));
    }
    fields.insert("f:deep".into(), deep);
    let env: Vec<Value> = (0..200)
        .map(|e| json!({"name": format!("V{e}"), "value": "x".repeat(64)}))
        .collect();
    let mut metadata = json!({
        "name": format!("d{i}"), "namespace": "llm", "uid": format!("uid-{i}"),
        "resourceVersion": format!("{}", 1000 + i), "generation": 3,
        "creationTimestamp": "2026-11-24T00:00:00Z",
        "labels": {"app": "vllm", "role": "decode", "model": "llama"},
        "annotations": {"disagg.io/kv-connector": "NixlConnector", "disagg.io/tp-size": "2"},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs",
            "uid": "u", "controller": true, "blockOwnerDeletion": true}],
        "managedFields": [{"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
            "time": "2026-11-24T00:00:10Z", "fieldsType": "FieldsV1", "fieldsV1": fields}],
    });
    if i == 0 {
        metadata["deletionTimestamp"] = json!("2026-11-24T00:01:00Z");
    }
    json!({
        "metadata": metadata,
        "spec": {
            "containers": [{
                "name": "engine", "image": "vllm/vllm-openai", "env": env,
                "ports": [
                    {"name": "http", "containerPort": 8000, "protocol": "TCP"},
                    {"name": "metrics", "containerPort": 9000 + i, "protocol": "TCP"},
                ],
            }],
            "volumes": vec![json!({"name": ""}); VOLUMES],
        },
        "status": {
            "phase": "Running", "podIP": format!("10.0.0.{}", i + 1),
            "podIPs": [{"ip": format!("10.0.0.{}", i + 1)}],
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-24T00:00:00Z"},
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-24T00:00:09Z"},
            ],
            "containerStatuses": [{"name": "engine", "ready": true, "restartCount": 0,
                "image": "vllm/vllm-openai", "imageID": "sha256:0",
                "state": {"running": {"startedAt": "2026-11-24T00:00:10Z"}}}],
        },
    })
}

/// The heap bytes of a string.
fn string(s: &Option<String>) -> usize {
    s.as_ref().map_or(0, String::capacity)
}

/// The heap bytes of a map: its strings, and its B-tree's nodes, whose size std does not
/// say: those of a clone, which has the same shape (counted with [`held`]), less the
/// clone's strings.
fn map(m: &Option<BTreeMap<String, String>>) -> usize {
    let Some(m) = m else { return 0 };
    let strings = |m: &BTreeMap<String, String>| -> usize {
        m.iter().map(|(k, v)| k.capacity() + v.capacity()).sum()
    };
    let (clone, bytes) = held(|| m.clone());
    strings(m) + bytes - strings(&clone)
}

/// The heap bytes of the fields a decoded page keeps: its pods' vector, and in each pod
/// the strings, vectors and maps of the fields discovery reads.
fn kept(list: &ObjectList<EnginePod>) -> usize {
    let meta = &list.metadata;
    let list_bytes = list.types.api_version.capacity()
        + list.types.kind.capacity()
        + string(&meta.resource_version)
        + string(&meta.continue_)
        + string(&meta.self_link)
        + list.items.capacity() * size_of::<EnginePod>();
    let pod = |p: &EnginePod| -> usize {
        let m = &p.metadata;
        let meta = string(&m.name)
            + string(&m.namespace)
            + string(&m.uid)
            + string(&m.resource_version)
            + map(&m.labels)
            + map(&m.annotations);
        let spec = p.spec.as_ref().map_or(0, |s| {
            s.containers.capacity() * size_of::<EngineContainer>()
                + s.containers
                    .iter()
                    .filter_map(|c| c.ports.as_ref())
                    .map(|ports| {
                        ports.capacity() * size_of::<EngineContainerPort>()
                            + ports.iter().map(|p| string(&p.name)).sum::<usize>()
                    })
                    .sum::<usize>()
        });
        let status = p.status.as_ref().map_or(0, |s| {
            string(&s.phase)
                + string(&s.pod_ip)
                + s.conditions.as_ref().map_or(0, |c| {
                    c.capacity() * size_of::<EnginePodCondition>()
                        + c.iter()
                            .map(|c| c.type_.capacity() + c.status.capacity())
                            .sum::<usize>()
                })
        });
        meta + spec + status
    };
    list_bytes + list.items.iter().map(pod).sum::<usize>()
}

/// A page of [`PODS`] pods of about 95 KB each decoded into slim pods holds nothing but
/// the fields discovery reads (its pods' vector and their kept strings, vectors and
/// maps, counted from the result: about 2.1 KB a pod), with those fields intact; decoded
/// into k8s-openapi's `Pod`s, the same page holds over a thousand times as much.
#[test]
fn a_page_decodes_into_slim_pods_that_hold_only_the_fields_read() {
    let _alone = alone();
    let page = json!({
        "kind": "PodList", "apiVersion": "v1",
        "metadata": {"resourceVersion": "2000"},
        "items": (0..PODS).map(pod).collect::<Vec<_>>(),
    })
    .to_string();
    assert!(page.len() > 700_000, "{}", page.len());

    let (slim, slim_held) = held(|| -> ObjectList<EnginePod> {
        serde_json::from_str(&page).expect("a page of slim pods")
    });
    let kept = kept(&slim);
    let (full, full_held) =
        held(|| -> ObjectList<Pod> { serde_json::from_str(&page).expect("a page of pods") });
    eprintln!(
        "a page of {PODS} pods, {} bytes: as EnginePods it holds {slim_held} bytes \
         (the fields read: {kept}); as k8s-openapi Pods, {full_held} bytes ({})",
        page.len(),
        mb(full_held),
    );
    assert!(
        slim_held <= kept,
        "the slim page holds {slim_held} bytes, {} more than the fields it keeps",
        slim_held - kept
    );
    assert!(kept < PODS * 3 * 1024, "{kept} bytes kept for {PODS} pods");
    assert!(
        full_held > 1000 * slim_held,
        "as k8s-openapi Pods: {full_held} bytes; as EnginePods: {slim_held}"
    );

    // What discovery reads is intact.
    assert_eq!(slim.items.len(), PODS);
    for (i, p) in slim.items.iter().enumerate() {
        let meta = &p.metadata;
        assert_eq!(meta.name.as_deref(), Some(format!("d{i}").as_str()));
        assert_eq!(meta.namespace.as_deref(), Some("llm"));
        assert_eq!(meta.uid.as_deref(), Some(format!("uid-{i}").as_str()));
        let version = format!("{}", 1000 + i);
        assert_eq!(meta.resource_version.as_deref(), Some(version.as_str()));
        assert_eq!(meta.deletion_timestamp.is_some(), i == 0);
        let labels = meta.labels.as_ref().expect("labels");
        assert_eq!(labels.get("model").map(String::as_str), Some("llama"));
        let annotations = meta.annotations.as_ref().expect("annotations");
        assert_eq!(
            annotations.get("disagg.io/tp-size").map(String::as_str),
            Some("2")
        );
        // Skipped, not decoded.
        assert!(meta.managed_fields.is_none() && meta.owner_references.is_none());
        assert!(meta.generation.is_none() && meta.creation_timestamp.is_none());
        let ports = &p.spec.as_ref().expect("spec").containers[0]
            .ports
            .as_ref()
            .expect("ports");
        assert_eq!(ports.len(), 2);
        assert_eq!(ports[0].name.as_deref(), Some("http"));
        assert_eq!(ports[0].container_port, 8000);
        assert_eq!(ports[1].container_port, 9000 + i as i32);
        let status = p.status.as_ref().expect("status");
        assert_eq!(status.phase.as_deref(), Some("Running"));
        let ip = format!("10.0.0.{}", i + 1);
        assert_eq!(status.pod_ip.as_deref(), Some(ip.as_str()));
        let conditions = status.conditions.as_ref().expect("conditions");
        assert_eq!(conditions.len(), 2);
        assert_eq!(
            (conditions[1].type_.as_str(), conditions[1].status.as_str()),
            ("Ready", "True")
        );
    }
    // The same page as k8s-openapi reads it.
    assert_eq!(full.items.len(), PODS);
    let volumes = full.items[0].spec.as_ref().and_then(|s| s.volumes.as_ref());
    assert_eq!(volumes.map(Vec::len), Some(VOLUMES));
}

/// The most a page or watch event may hold under the client's bounds, for pages of
/// `pods` pods (counted as at least 16): bytes, JSON objects and JSON values.
fn limits(pods: usize) -> (usize, usize, usize) {
    let pods = pods.max(16);
    (64 << 20, pods * 4096, pods * 16_384)
}

/// The JSON objects (`{`) and values (`[` and `,`) of `text`, which has no strings
/// holding any of the three.
fn counts(text: &str) -> (usize, usize) {
    let count = |c: u8| text.bytes().filter(|&b| b == c).count();
    (count(b'{'), count(b'[') + count(b','))
}

/// `prefix`, a labels map of `members` members and `suffix`, in `bytes` bytes: the
/// members in ascending order of their keys (which leaves the map's B-tree nodes half
/// full), their values sharing the bytes left. With `one_escaped`, every value is empty
/// but the last, which takes those bytes and starts with an escape: serde_json assembles
/// it in its scratch buffer.
fn with_labels(
    prefix: &str,
    members: usize,
    suffix: &str,
    bytes: usize,
    one_escaped: bool,
) -> String {
    let width = members.to_string().len();
    // `"KEY":""` and a `,` between members, in `{` and `}`.
    let room = bytes - prefix.len() - suffix.len() - (members * (width + 6) - 1) - 2;
    let mut text = String::with_capacity(bytes);
    text.push_str(prefix);
    text.push('{');
    for m in 0..members {
        let len = if one_escaped {
            if m + 1 == members { room } else { 0 }
        } else {
            room / members + usize::from(m < room % members)
        };
        if m > 0 {
            text.push(',');
        }
        write!(text, r#""{m:0width$}":""#).expect("a String takes it");
        if one_escaped && len > 0 {
            text.push_str(r"\n");
            text.push_str(&"v".repeat(len - 2));
        } else {
            text.push_str(&"v".repeat(len));
        }
        text.push('"');
    }
    text.push('}');
    text.push_str(suffix);
    assert_eq!(text.len(), bytes);
    text
}

/// The page of `pods` pods (counted as at least 16) that decodes into the most a page
/// can within the bounds, as far as we know: one pod more than a power of two, so that
/// their vector grows to twice as many slots (456 bytes each, filled or not), the first
/// with labels taking the values left (each a member of its own), as many of the others
/// as the objects left allow with one-member labels and annotations (a whole B-tree leaf
/// each, 544 bytes for a JSON object), the rest empty (`{}`).
fn worst_page(pods: usize, one_escaped: bool) -> String {
    let (bytes, objects, values) = limits(pods);
    // The page's object, the first pod's three, and one for each other pod.
    let total = (objects - 4).next_power_of_two() / 2 + 1;
    // Three more for each pod with small maps: its metadata, labels and annotations.
    let small = (objects - 3 - total) / 3;
    let empty = objects - 4 - 4 * small;
    // `[`, a `,` before each pod after the first and one in each pod with small maps; a
    // `,` before each member after the first.
    let members = values - (1 + small + empty) - small + 1;
    let suffix = format!(
        "}}}}{}{}]}}",
        r#",{"metadata":{"labels":{"":""},"annotations":{"":""}}}"#.repeat(small),
        ",{}".repeat(empty)
    );
    let page = with_labels(
        r#"{"items":[{"metadata":{"labels":"#,
        members,
        &suffix,
        bytes,
        one_escaped,
    );
    assert_eq!(counts(&page), (objects, values));
    page
}

/// Decodes the worst page of `pods` pods into slim pods, its labels' values many
/// strings, then one escaped, and prints what each holds once decoded (and, for the
/// first, what the process's resident memory grew by: the allocator's rounding in, the
/// vector's slots never written out) and peaks at while it decodes; returns what the
/// first holds and the peaks.
fn measure_worst(pods: usize) -> (usize, [Option<usize>; 2]) {
    let mut peaks = [None; 2];
    let mut first = 0;
    for (i, escaped) in [false, true].into_iter().enumerate() {
        let page = worst_page(pods, escaped);
        let rss = resident();
        let ((list, held), _, peak) = during(|| {
            held(|| -> ObjectList<EnginePod> { serde_json::from_str(&page).expect("the page") })
        });
        let rss = rss.zip(resident()).map(|(a, b)| b.saturating_sub(a));
        let labels = list.items[0]
            .metadata
            .labels
            .as_ref()
            .map_or(0, BTreeMap::len);
        eprintln!(
            "the worst page of {pods}, {}: {} pods, {labels} labels; holds {}{}, peak {}, \
             its text besides",
            if escaped {
                "one escaped value"
            } else {
                "many values"
            },
            list.items.len(),
            mb(held),
            rss.filter(|_| !escaped)
                .map_or(String::new(), |r| format!(" (resident {})", mb(r))),
            shown(peak),
        );
        if escaped {
            assert!(held <= first, "{held} {first}");
        } else {
            first = held;
        }
        peaks[i] = peak;
    }
    (first, peaks)
}

/// The worst page of 100 pods (the default) holds about 0.47 GB (262,147 pods in a
/// vector grown to 524,288 slots: 239 MB; 49,150 pairs of one-member maps: 53 MB;
/// 1,327,104 labels), and peaks at about 0.52 GB while it decodes with its labels' text
/// one escaped string.
#[test]
#[ignore = "takes 0.6 GB; prints the figures of bounds.rs"]
fn the_worst_default_page_takes_about_half_a_gigabyte() {
    let _alone = alone();
    let (held, peaks) = measure_worst(100);
    assert!(held < 480_000_000, "{held}");
    for peak in peaks.into_iter().flatten() {
        assert!(peak < 530_000_000, "{peak}");
    }
}

/// The worst page of 16 pods holds about 0.13 GB, half of it its labels' 64 MiB of
/// text, and peaks at about 0.19 GB while it decodes with that text one escaped string.
#[test]
#[ignore = "takes 0.3 GB; prints the figures of bounds.rs"]
fn the_worst_page_of_16_takes_under_a_fifth_of_a_gigabyte() {
    let _alone = alone();
    let (held, peaks) = measure_worst(16);
    assert!(held < 130_000_000, "{held}");
    for peak in peaks.into_iter().flatten() {
        assert!(peak < 200_000_000, "{peak}");
    }
}

/// A JSON array of `objects` JSON objects and `values` JSON values, each object one of
/// one member, each value (but the array's own and its `,`s) an array of one element, in
/// chains 100 deep (serde_json reads 128 at most): what serde's `Content` buffers at the
/// most bytes for each.
fn nested(objects: usize, values: usize) -> String {
    const DEPTH: usize = 100;
    let mut text = String::from("[");
    let (mut objects, mut values) = (objects, values - 1);
    let mut first = true;
    while objects > 0 || values > 0 {
        if !first {
            text.push(',');
            values -= 1;
        }
        first = false;
        let (open, close, left) = if objects > 0 {
            (r#"{"":"#, "}", &mut objects)
        } else {
            ("[", "]", &mut values)
        };
        let depth = DEPTH.min(*left);
        *left -= depth;
        text.push_str(&open.repeat(depth));
        text.push('0');
        text.push_str(&close.repeat(depth));
    }
    text.push(']');
    text
}

/// The worst watch event within the counts of a default page, its `object` before its
/// `type` (so that it is buffered whole into serde's `Content` first), peaks under
/// 0.5 GB: a pod whose labels take the values (each in `Content`, then in the map; their
/// text one escaped string) and whose skipped member takes the objects (each in
/// `Content`).
#[test]
#[ignore = "takes 0.6 GB; prints the figures of bounds.rs"]
fn the_worst_watch_event_peaks_under_half_a_gigabyte() {
    let _alone = alone();
    let (bytes, objects, values) = limits(100);
    // The event's object, the pod's, its metadata's and labels'.
    let skipped_objects = objects - 4;
    // Its `[`, and a `,` between chains of 100 objects.
    let skipped_values = skipped_objects.div_ceil(100);
    let suffix = format!(
        r#"}},"x":{}}},"type":"ADDED"}}"#,
        nested(skipped_objects, skipped_values)
    );
    // The `,`s before `x` and `type`; a `,` before each member after the first.
    let members = values - skipped_values - 2 + 1;
    let event = with_labels(
        r#"{"object":{"metadata":{"labels":"#,
        members,
        &suffix,
        bytes,
        true,
    );
    drop(suffix);
    assert_eq!(counts(&event), (objects, values));
    let (event, total, peak) =
        during(|| -> WatchEvent<EnginePod> { serde_json::from_str(&event).expect("the event") });
    let WatchEvent::Added(pod) = event else {
        panic!("{event:?}")
    };
    let labels = pod.metadata.labels.as_ref().map_or(0, BTreeMap::len);
    eprintln!(
        "the worst watch event: {labels} labels; {} allocated while it decoded, peak {}",
        mb(total),
        shown(peak),
    );
    assert_eq!(labels, members);
    if let Some(peak) = peak {
        assert!(peak < 500_000_000, "{peak}");
    }
}

/// A watch event whose `object` comes before its `type` is buffered whole into serde's
/// `Content` (kube's `WatchEvent` is adjacently tagged) before the pod is decoded from
/// it, the parts skipped included, and so is a list's member other than `metadata` and
/// `items` (`ObjectList` flattens its `TypeMeta`): within the counts, about 0.3 GB for
/// those of a default page. With `type` first, nothing is.
#[test]
#[ignore = "takes 0.3 GB; prints the figures of bounds.rs"]
fn what_serde_buffers_is_bounded_by_the_counts() {
    let _alone = alone();
    let (_, objects, values) = limits(100);
    // The event's object, the pod's and its metadata's; the `,`s before `x` and `type`.
    let skipped = nested(objects - 3, values - 2);
    let pod = format!(r#"{{"metadata":{{"name":"p"}},"x":{skipped}}}"#);
    let late = format!(r#"{{"object":{pod},"type":"ADDED"}}"#);
    assert_eq!(counts(&late), (objects, values));
    let early = format!(r#"{{"type":"ADDED","object":{pod}}}"#);
    drop((skipped, pod));
    let mut allocated = Vec::new();
    for (name, event) in [("type last", &late), ("type first", &early)] {
        let (event, total, peak) =
            during(|| -> WatchEvent<EnginePod> { serde_json::from_str(event).expect("the event") });
        let WatchEvent::Added(pod) = event else {
            panic!("{event:?}")
        };
        assert_eq!(pod.metadata.name.as_deref(), Some("p"));
        eprintln!(
            "a watch event of {} bytes, {objects} objects, {values} values, {name}: \
             {} allocated while it decoded, peak {}",
            late.len(),
            mb(total),
            shown(peak),
        );
        allocated.push(total);
    }
    assert!(allocated[0] > 100_000_000, "{allocated:?}");
    assert!(allocated[1] < 10_000, "{allocated:?}");
    assert!(allocated[0] < 400_000_000, "{allocated:?}");
    drop((late, early));
    // The page's object; the `,` before `items`, its `[`.
    let page = format!(r#"{{"x":{},"items":[]}}"#, nested(objects - 1, values - 2));
    assert_eq!(counts(&page), (objects, values));
    let (list, total, peak) =
        during(|| -> ObjectList<EnginePod> { serde_json::from_str(&page).expect("the page") });
    assert!(list.items.is_empty());
    eprintln!(
        "a page of {} bytes, {objects} objects, {values} values, all in a member not read: \
         {} allocated while it decoded, peak {}",
        page.len(),
        mb(total),
        shown(peak),
    );
    assert!(total < 400_000_000, "{total}");
}
