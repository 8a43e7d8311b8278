//! The pods discovery watches, decoded into the few fields it reads.
//!
//! k8s-openapi's `Pod` decodes a pod whole, into a deep typed tree: an empty
//! `{"name":""}` in `spec.volumes` becomes a `Volume` of about 3.2 KB, a
//! `managedFields[].fieldsV1` a `serde_json::Value` tree, and the reflector's store keeps
//! every pod so. An [`EnginePod`] holds only what discovery reads (`metadata.{name,
//! namespace, uid, resourceVersion, labels, annotations, deletionTimestamp}`,
//! `spec.containers[].ports[].{name, containerPort}`, `status.{phase, podIP,
//! conditions[].{type, status}}`); every other member of a pod is skipped as it is read
//! (serde's `IgnoredAny`: serde_json steps over it without allocating). That holds of a
//! pod read from the text; two of kube-rs's wrappers buffer what they read first, into
//! serde's `Content` (up to 256 bytes for each JSON object, 128 for each value): a
//! `WatchEvent`, adjacently tagged, whose `object` comes before its `type` is read whole,
//! the members skipped here included, before the pod is decoded from it, and an
//! `ObjectList`, which flattens its `TypeMeta`, keeps each of a list's members besides
//! `metadata` and `items` until the list ends. The API server sends neither (`type`
//! comes first; a list's other members are `kind` and `apiVersion`), and the client's
//! counts of JSON objects and values bound both (`bounds.rs`, `tests/pod_memory.rs`).
//!
//! Each type is read from a JSON object only, as k8s-openapi's are: serde's derive would
//! also take an array of a struct's fields in order, so that `[]` (2 bytes, no JSON
//! object) would be a whole pod, past the count of objects the client bounds a page by.
//! Missing and `null` members are left at their default, as k8s-openapi does (a
//! `containerPort` too: 0), and a later duplicate member wins.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::Deserialize;
use serde::de::{self, DeserializeOwned, DeserializeSeed, Deserializer, IgnoredAny, MapAccess};

/// A pod as Kubernetes discovery decodes it: only the fields it reads (see
/// [`pod_spec`](super::pod_spec)), every other field of the pod skipped as it is read,
/// so that a pod takes little more memory than these fields' strings, whatever else it
/// holds (`managedFields`, volumes, environment variables, owner references...).
///
/// A Kubernetes resource of kind `Pod` (`v1`, namespaced) to kube-rs: its `Api`,
/// watcher and reflector take it as they take k8s-openapi's `Pod`.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct EnginePod {
    /// Its `metadata`: `name`, `namespace`, `uid`, `resourceVersion` (what kube-rs's
    /// watcher and store use), `labels`, `annotations` and `deletionTimestamp`; every
    /// other field is left empty.
    pub metadata: ObjectMeta,
    /// Its `spec`: its containers' ports.
    pub spec: Option<EnginePodSpec>,
    /// Its `status`: its phase, IP and conditions.
    pub status: Option<EnginePodStatus>,
}

/// The part of a pod's `spec` discovery reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EnginePodSpec {
    /// `containers`.
    pub containers: Vec<EngineContainer>,
}

/// The part of a container (`spec.containers[]`) discovery reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineContainer {
    /// `ports`.
    pub ports: Option<Vec<EngineContainerPort>>,
}

/// A container's port (`spec.containers[].ports[]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineContainerPort {
    /// `name`.
    pub name: Option<String>,
    /// `containerPort`.
    pub container_port: i32,
}

/// The part of a pod's `status` discovery reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EnginePodStatus {
    /// `phase` (`Running`, ...).
    pub phase: Option<String>,
    /// `podIP`.
    pub pod_ip: Option<String>,
    /// `conditions`.
    pub conditions: Option<Vec<EnginePodCondition>>,
}

/// A pod's condition (`status.conditions[]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EnginePodCondition {
    /// `type` (`Ready`, ...).
    pub type_: String,
    /// `status` (`True`, `False`, `Unknown`).
    pub status: String,
}

impl k8s_openapi::Resource for EnginePod {
    const API_VERSION: &'static str = "v1";
    const GROUP: &'static str = "";
    const KIND: &'static str = "Pod";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "pods";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for EnginePod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// A type read from a JSON object member by member, an unknown member's value skipped.
trait Members: Default {
    /// What it is, for errors.
    const EXPECTING: &'static str;
    /// Its members' names, an unknown one as a variant that [`member`](Self::member)
    /// skips.
    type Key: DeserializeOwned;
    /// Reads the value of the member `key` from `map` into `self`.
    fn member<'de, A: MapAccess<'de>>(
        &mut self,
        key: Self::Key,
        map: &mut A,
    ) -> Result<(), A::Error>;
}

/// Reads a `T` from a JSON object, and from nothing else.
fn object<'de, D: Deserializer<'de>, T: Members>(deserializer: D) -> Result<T, D::Error> {
    struct Object<T>(PhantomData<T>);

    impl<'de, T: Members> de::Visitor<'de> for Object<T> {
        type Value = T;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(T::EXPECTING)
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<T, A::Error> {
            let mut value = T::default();
            while let Some(key) = map.next_key::<T::Key>()? {
                value.member(key, &mut map)?;
            }
            Ok(value)
        }
    }

    deserializer.deserialize_map(Object(PhantomData))
}

/// The next value of `map`, `null` as the default.
fn or_default<'de, A: MapAccess<'de>, T: Deserialize<'de> + Default>(
    map: &mut A,
) -> Result<T, A::Error> {
    Ok(map.next_value::<Option<T>>()?.unwrap_or_default())
}

/// Skips the next value of `map` without decoding it.
fn skip<'de, A: MapAccess<'de>>(map: &mut A) -> Result<(), A::Error> {
    map.next_value::<IgnoredAny>().map(drop)
}

/// A string that must be this one (a pod's `apiVersion` and `kind`, checked as
/// k8s-openapi checks them), compared without being kept.
struct Expect(&'static str);

impl<'de> DeserializeSeed<'de> for Expect {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl de::Visitor<'_> for Expect {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`", self.0)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        if v == self.0 {
            Ok(())
        } else {
            Err(E::invalid_value(de::Unexpected::Str(v), &self))
        }
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum PodKey {
    ApiVersion,
    Kind,
    Metadata,
    Spec,
    Status,
    #[serde(other)]
    Other,
}

impl Members for EnginePod {
    const EXPECTING: &'static str = "a pod (a JSON object)";
    type Key = PodKey;

    fn member<'de, A: MapAccess<'de>>(&mut self, key: PodKey, map: &mut A) -> Result<(), A::Error> {
        use k8s_openapi::Resource;
        match key {
            PodKey::ApiVersion => map.next_value_seed(Expect(Self::API_VERSION))?,
            PodKey::Kind => map.next_value_seed(Expect(Self::KIND))?,
            PodKey::Metadata => self.metadata = or_default::<_, Meta>(map)?.0,
            PodKey::Spec => self.spec = map.next_value()?,
            PodKey::Status => self.status = map.next_value()?,
            PodKey::Other => skip(map)?,
        }
        Ok(())
    }
}

/// A pod's `metadata`, only the fields [`EnginePod::metadata`] keeps.
#[derive(Default)]
struct Meta(ObjectMeta);

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum MetaKey {
    Name,
    Namespace,
    Uid,
    ResourceVersion,
    Labels,
    Annotations,
    DeletionTimestamp,
    #[serde(other)]
    Other,
}

impl Members for Meta {
    const EXPECTING: &'static str = "a pod's metadata (a JSON object)";
    type Key = MetaKey;

    fn member<'de, A: MapAccess<'de>>(
        &mut self,
        key: MetaKey,
        map: &mut A,
    ) -> Result<(), A::Error> {
        let meta = &mut self.0;
        match key {
            MetaKey::Name => meta.name = map.next_value()?,
            MetaKey::Namespace => meta.namespace = map.next_value()?,
            MetaKey::Uid => meta.uid = map.next_value()?,
            MetaKey::ResourceVersion => meta.resource_version = map.next_value()?,
            MetaKey::Labels => {
                meta.labels = map.next_value::<Option<BTreeMap<String, String>>>()?
            }
            MetaKey::Annotations => {
                meta.annotations = map.next_value::<Option<BTreeMap<String, String>>>()?;
            }
            MetaKey::DeletionTimestamp => {
                meta.deletion_timestamp = map.next_value::<Option<Time>>()?
            }
            MetaKey::Other => skip(map)?,
        }
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum SpecKey {
    Containers,
    #[serde(other)]
    Other,
}

impl Members for EnginePodSpec {
    const EXPECTING: &'static str = "a pod's spec (a JSON object)";
    type Key = SpecKey;

    fn member<'de, A: MapAccess<'de>>(
        &mut self,
        key: SpecKey,
        map: &mut A,
    ) -> Result<(), A::Error> {
        match key {
            SpecKey::Containers => self.containers = or_default(map)?,
            SpecKey::Other => skip(map)?,
        }
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum ContainerKey {
    Ports,
    #[serde(other)]
    Other,
}

impl Members for EngineContainer {
    const EXPECTING: &'static str = "a container (a JSON object)";
    type Key = ContainerKey;

    fn member<'de, A: MapAccess<'de>>(
        &mut self,
        key: ContainerKey,
        map: &mut A,
    ) -> Result<(), A::Error> {
        match key {
            ContainerKey::Ports => self.ports = map.next_value()?,
            ContainerKey::Other => skip(map)?,
        }
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum PortKey {
    Name,
    ContainerPort,
    #[serde(other)]
    Other,
}

impl Members for EngineContainerPort {
    const EXPECTING: &'static str = "a container port (a JSON object)";
    type Key = PortKey;

    fn member<'de, A: MapAccess<'de>>(
        &mut self,
        key: PortKey,
        map: &mut A,
    ) -> Result<(), A::Error> {
        match key {
            PortKey::Name => self.name = map.next_value()?,
            PortKey::ContainerPort => self.container_port = or_default(map)?,
            PortKey::Other => skip(map)?,
        }
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(field_identifier)]
enum StatusKey {
    #[serde(rename = "phase")]
    Phase,
    #[serde(rename = "podIP")]
    PodIp,
    #[serde(rename = "conditions")]
    Conditions,
    #[serde(other)]
    Other,
}

impl Members for EnginePodStatus {
    const EXPECTING: &'static str = "a pod's status (a JSON object)";
    type Key = StatusKey;

    fn member<'de, A: MapAccess<'de>>(
        &mut self,
        key: StatusKey,
        map: &mut A,
    ) -> Result<(), A::Error> {
        match key {
            StatusKey::Phase => self.phase = map.next_value()?,
            StatusKey::PodIp => self.pod_ip = map.next_value()?,
            StatusKey::Conditions => self.conditions = map.next_value()?,
            StatusKey::Other => skip(map)?,
        }
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(field_identifier)]
enum ConditionKey {
    #[serde(rename = "type")]
    Type,
    #[serde(rename = "status")]
    Status,
    #[serde(other)]
    Other,
}

impl Members for EnginePodCondition {
    const EXPECTING: &'static str = "a pod condition (a JSON object)";
    type Key = ConditionKey;

    fn member<'de, A: MapAccess<'de>>(
        &mut self,
        key: ConditionKey,
        map: &mut A,
    ) -> Result<(), A::Error> {
        match key {
            ConditionKey::Type => self.type_ = or_default(map)?,
            ConditionKey::Status => self.status = or_default(map)?,
            ConditionKey::Other => skip(map)?,
        }
        Ok(())
    }
}

/// `Deserialize` through [`object`] for each type.
macro_rules! from_object {
    ($($t:ty),*) => {$(
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                object(deserializer)
            }
        }
    )*};
}

from_object!(
    EnginePod,
    Meta,
    EnginePodSpec,
    EngineContainer,
    EngineContainerPort,
    EnginePodStatus,
    EnginePodCondition
);

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Pod;
    use kube::core::{ObjectList, WatchEvent};
    use serde_json::json;

    use super::super::held::apiserver::{PodDesc, heavy};
    use super::*;

    /// What discovery keeps of k8s-openapi's `pod`.
    fn kept(pod: &Pod) -> EnginePod {
        let m = &pod.metadata;
        EnginePod {
            metadata: ObjectMeta {
                name: m.name.clone(),
                namespace: m.namespace.clone(),
                uid: m.uid.clone(),
                resource_version: m.resource_version.clone(),
                labels: m.labels.clone(),
                annotations: m.annotations.clone(),
                deletion_timestamp: m.deletion_timestamp.clone(),
                ..ObjectMeta::default()
            },
            spec: pod.spec.as_ref().map(|s| EnginePodSpec {
                containers: s
                    .containers
                    .iter()
                    .map(|c| EngineContainer {
                        ports: c.ports.as_ref().map(|ports| {
                            ports
                                .iter()
                                .map(|p| EngineContainerPort {
                                    name: p.name.clone(),
                                    container_port: p.container_port,
                                })
                                .collect()
                        }),
                    })
                    .collect(),
            }),
            status: pod.status.as_ref().map(|s| EnginePodStatus {
                phase: s.phase.clone(),
                pod_ip: s.pod_ip.clone(),
                conditions: s.conditions.as_ref().map(|conditions| {
                    conditions
                        .iter()
                        .map(|c| EnginePodCondition {
                            type_: c.type_.clone(),
                            status: c.status.clone(),
                        })
                        .collect()
                }),
            }),
        }
    }

    fn desc(name: &str) -> PodDesc<'_> {
        PodDesc {
            namespace: "llm",
            name,
            labels: &[("app", "vllm"), ("model", "llama")],
            annotations: &[("disagg.io/tp-size", "2"), ("disagg.io/models", "a,b")],
            ip: "10.0.0.7",
            port: 8100,
            phase: "Running",
            ready: true,
        }
    }

    /// A pod decodes into what k8s-openapi's `Pod` holds of the fields discovery reads:
    /// a plain pod, a heavy real one, one being deleted, one whose members come with
    /// escaped names, repeated, `null` or missing, and one with large parts discovery
    /// does not read (skipped).
    #[test]
    fn a_pod_decodes_into_what_k8s_openapi_has_of_the_fields_read() {
        let mut deleted = desc("d").json();
        deleted["metadata"]["deletionTimestamp"] = json!("2026-11-24T00:01:00Z");
        deleted["metadata"]["uid"] = json!("6f1c");
        deleted["metadata"]["resourceVersion"] = json!("812");
        let mut bulky = heavy(desc("b").json(), 3, 60);
        bulky["spec"]["volumes"] = json!(vec![json!({"name": ""}); 5000]);
        bulky["metadata"]["managedFields"][0]["fieldsV1"]["f:wide"] = json!(vec![
            json!({"a": [1, 2.5, "x\"y", null, true, {"b": []}]});
            1000
        ]);
        let odd = r#"{
            "metadata": {"na\u006de": "escaped", "namespace": null, "labels": null,
                "annotations": {"k": "v", "k\"\\": "w"}, "uid": "u1", "uid": "u2"},
            "spec": {"containers": [{"ports": null}, {}, {"ports": [{}, {"containerPort": null, "name": "p"}]}]},
            "status": {"phase": "Pending", "conditions": [{}, {"type": null, "status": "True"}]}
        }"#;
        let empty = r#"{"metadata": null, "spec": {"containers": null}, "status": null}"#;
        let texts = [
            desc("p").json(),
            heavy(desc("h").json(), 3, 60),
            deleted,
            bulky,
        ]
        .map(|pod| pod.to_string());
        for text in texts.iter().map(String::as_str).chain([odd, empty, "{}"]) {
            let slim: EnginePod = serde_json::from_str(text).unwrap();
            let full: Pod = serde_json::from_str(text).unwrap();
            assert_eq!(slim, kept(&full), "{}", &text[..text.len().min(300)]);
        }
        let odd: EnginePod = serde_json::from_str(odd).unwrap();
        assert_eq!(odd.metadata.name.as_deref(), Some("escaped"));
        assert_eq!(odd.metadata.uid.as_deref(), Some("u2"));
        let annotations = odd.metadata.annotations.unwrap();
        assert_eq!(annotations.get("k\"\\").map(String::as_str), Some("w"));
        let ports = odd.spec.unwrap().containers[2].ports.clone().unwrap();
        assert_eq!(
            ports[1],
            EngineContainerPort {
                name: Some("p".into()),
                container_port: 0
            }
        );
    }

    /// Every type is read from a JSON object only: an array of its fields in order (which
    /// serde's derive would take) is refused, as k8s-openapi refuses it, so that no pod,
    /// container, port or condition is decoded without a JSON object counted for it.
    #[test]
    fn arrays_are_refused_where_objects_are_read() {
        for text in [
            "[]",
            "[{}, null, null]",
            r#"{"metadata": []}"#,
            r#"{"metadata": ["a", "llm"]}"#,
            r#"{"spec": []}"#,
            r#"{"spec": [[]]}"#,
            r#"{"spec": {"containers": [[]]}}"#,
            r#"{"spec": {"containers": [{"ports": [[]]}]}}"#,
            r#"{"spec": {"containers": [{"ports": [["http", 80]]}]}}"#,
            r#"{"status": []}"#,
            r#"{"status": {"conditions": [["Ready", "True"]]}}"#,
            r#"{"spec": {"containers": [null]}}"#,
        ] {
            assert!(serde_json::from_str::<EnginePod>(text).is_err(), "{text}");
            assert!(
                serde_json::from_str::<Pod>(text).is_err(),
                "k8s-openapi: {text}"
            );
        }
    }

    /// A pod's `apiVersion` and `kind`, when present, must be `v1` and `Pod`, as
    /// k8s-openapi checks them.
    #[test]
    fn api_version_and_kind_are_checked() {
        for (text, ok) in [
            (r#"{"apiVersion": "v1", "kind": "Pod"}"#, true),
            (r#"{"kind": "Service"}"#, false),
            (r#"{"apiVersion": "apps/v1"}"#, false),
            (r#"{"kind": null}"#, false),
            (r#"{"kind": 1}"#, false),
        ] {
            assert_eq!(
                serde_json::from_str::<EnginePod>(text).is_ok(),
                ok,
                "{text}"
            );
            assert_eq!(
                serde_json::from_str::<Pod>(text).is_ok(),
                ok,
                "k8s-openapi: {text}"
            );
        }
    }

    /// kube-rs's list and watch-event wrappers decode it, a watch event whether its
    /// `type` comes before its `object` (as the API server writes it) or after.
    #[test]
    fn lists_and_watch_events_of_it_decode() {
        let pod = desc("p").json();
        let list = json!({"kind": "PodList", "apiVersion": "v1",
            "metadata": {"resourceVersion": "9"}, "items": [pod, pod]});
        let list: ObjectList<EnginePod> = serde_json::from_value(list).unwrap();
        assert_eq!(list.items.len(), 2);
        assert_eq!(list.metadata.resource_version.as_deref(), Some("9"));
        let text = pod.to_string();
        for line in [
            format!(r#"{{"type":"ADDED","object":{text}}}"#),
            format!(r#"{{"object":{text},"type":"ADDED"}}"#),
        ] {
            let Ok(WatchEvent::Added(p)) = serde_json::from_str::<WatchEvent<EnginePod>>(&line)
            else {
                panic!("{line}");
            };
            assert_eq!(p.metadata.name.as_deref(), Some("p"));
            assert_eq!(p.status.unwrap().pod_ip.as_deref(), Some("10.0.0.7"));
        }
    }

    /// An empty pod (`{}`) is 456 bytes at most, as bounds.rs counts it.
    #[test]
    fn an_empty_pod_is_as_small_as_the_bounds_count_it() {
        assert!(
            std::mem::size_of::<EnginePod>() <= 456,
            "{}: update bounds.rs's figures",
            std::mem::size_of::<EnginePod>()
        );
    }
}
