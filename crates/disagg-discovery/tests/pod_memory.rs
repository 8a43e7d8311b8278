//! What a page of pods decodes into: discovery's [`EnginePod`] keeps the few fields it
//! reads and skips the rest of each pod as it is read, where k8s-openapi's `Pod` decodes
//! it whole (an empty `{"name":""}` volume into a `Volume` of about 3.2 KB, a
//! `managedFields[].fieldsV1` into a `serde_json::Value` tree).
//!
//! Alone in its test binary, so that no other test allocates in the process while the
//! memory is measured (under `cargo test` as under nextest). No allocator can be counted
//! here (the workspace forbids `unsafe`, which a `#[global_allocator]` needs): what is
//! measured is the memory the process asked the system for (`VmData` of
//! `/proc/self/status`: the heap, the allocator's arenas and its mappings) while the
//! decoded pages are held. k8s-openapi's `Pod`, decoded from the same page, shows that
//! the measure sees what a decoding keeps.

#![cfg(target_os = "linux")]

use disagg_discovery::kubernetes::EnginePod;
use k8s_openapi::api::core::v1::Pod;
use kube::core::ObjectList;
use serde_json::{Value, json};

const MIB: u64 = 1024 * 1024;
/// Pods in the page.
const PODS: usize = 8;
/// Empty volumes in each pod's spec.
const VOLUMES: usize = 2_000;
/// Members of each pod's `fieldsV1` (as wide as it is), besides a chain 100 deep.
const FIELDS: usize = 4_000;
/// How many times the page is decoded into slim pods, every result held.
const SLIM_DECODES: usize = 20;

/// The process's private data memory (`VmData`), in bytes.
fn data_size() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmData:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmData line");
    kib * 1024
}

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

/// A page of [`PODS`] pods decoded into slim pods [`SLIM_DECODES`] times, every result
/// held, asks the system for under 4 MiB (a fraction of one page's text, which is
/// about 1 MB), with the fields discovery reads intact; decoded once into
/// k8s-openapi's `Pod`, the same page takes more than 32 MiB.
#[test]
fn a_page_decodes_into_slim_pods_that_allocate_little() {
    let items: Vec<Value> = (0..PODS).map(pod).collect();
    let page = json!({
        "kind": "PodList", "apiVersion": "v1",
        "metadata": {"resourceVersion": "2000"}, "items": items,
    })
    .to_string();
    drop(items);
    assert!(page.len() > 700_000, "{}", page.len());

    let before = data_size();
    let slim: Vec<ObjectList<EnginePod>> = (0..SLIM_DECODES)
        .map(|_| serde_json::from_str(&page).expect("a page of slim pods"))
        .collect();
    let slim_grown = data_size().saturating_sub(before);

    let before = data_size();
    let full: ObjectList<Pod> = serde_json::from_str(&page).expect("a page of pods");
    let full_grown = data_size().saturating_sub(before);

    eprintln!(
        "page: {} bytes; {SLIM_DECODES} slim decodes held: {slim_grown} bytes; one k8s-openapi decode held: {full_grown} bytes",
        page.len()
    );
    assert!(
        full_grown > 32 * MIB,
        "the measure sees a full decode: {full_grown} bytes"
    );
    assert!(
        slim_grown < 4 * MIB,
        "{SLIM_DECODES} slim decodes of the page take {slim_grown} bytes"
    );

    // What discovery reads is intact, in every decode.
    for list in &slim {
        assert_eq!(list.items.len(), PODS);
        for (i, p) in list.items.iter().enumerate() {
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
    }
    // The same page as k8s-openapi reads it.
    assert_eq!(full.items.len(), PODS);
    assert_eq!(
        full.items[0]
            .spec
            .as_ref()
            .unwrap()
            .volumes
            .as_ref()
            .unwrap()
            .len(),
        VOLUMES
    );
}
