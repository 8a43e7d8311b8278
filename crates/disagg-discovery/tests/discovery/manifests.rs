//! The example manifests of deploy/kubernetes/ work with discovery: the proxy's RBAC
//! allows what the watcher does, and the vLLM pods, once running and ready, are found
//! by the proxy's own selectors and port through kube-rs and the in-test API server,
//! with every annotation read.

use std::path::PathBuf;
use std::time::Duration;

use disagg_core::{EndpointSource, Role};
use disagg_discovery::kubernetes::{self, ClientConfig, KubernetesConfig};
use disagg_discovery::{KvEventsEndpoint, MergedSource};
use disagg_pairing::{KvProfile, KvRole};
use serde_json::{Value, json};

use crate::apiserver::FakeApiServer;
use crate::support::{TempDir, ids, wait_for};

fn manifests(file: &str) -> Vec<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/kubernetes")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_multiple::<Value>(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

/// The value of `--flag=VALUE` among the proxy's args.
fn flag(args: &[Value], name: &str) -> Option<String> {
    args.iter()
        .filter_map(Value::as_str)
        .find_map(|a| a.strip_prefix(&format!("--{name}=")).map(str::to_owned))
}

#[test]
fn the_proxy_may_get_list_and_watch_pods_in_its_namespace() {
    let rbac = manifests("rbac.yaml");
    let proxy = manifests("proxy.yaml");
    let account = kind(&rbac, "ServiceAccount")["metadata"]["name"].clone();
    let deployment = kind(&proxy, "Deployment");
    assert_eq!(
        deployment["spec"]["template"]["spec"]["serviceAccountName"],
        account
    );
    let binding = kind(&rbac, "RoleBinding");
    assert_eq!(binding["subjects"][0]["name"], account);
    let role = kind(&rbac, "Role");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    let rule = &role["rules"][0];
    assert_eq!(rule["apiGroups"], json!([""]));
    assert_eq!(rule["resources"], json!(["pods"]));
    assert_eq!(rule["verbs"], json!(["get", "list", "watch"]));
}

#[tokio::test]
async fn the_example_vllm_pods_are_found_with_the_proxys_flags() {
    let proxy = manifests("proxy.yaml");
    let args = kind(&proxy, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .clone();
    let mut config = KubernetesConfig::new(
        flag(&args, "k8s-prefill-selector"),
        flag(&args, "k8s-decode-selector"),
    );
    config.port = flag(&args, "k8s-port").map(|p| p.parse().unwrap());
    assert!(config.prefill_selector.is_some() && config.decode_selector.is_some());

    // Each Deployment's pod template, as the pod the kubelet runs, ready.
    let server = FakeApiServer::start().await;
    for (file, ip) in [
        ("vllm-prefill.yaml", "127.0.3.1"),
        ("vllm-decode.yaml", "127.0.4.1"),
    ] {
        let docs = manifests(file);
        let deployment = kind(&docs, "Deployment");
        let template = &deployment["spec"]["template"];
        let mut metadata = template["metadata"].clone();
        metadata["name"] = json!(format!(
            "{}-0",
            deployment["metadata"]["name"].as_str().unwrap()
        ));
        metadata["namespace"] = deployment["metadata"]["namespace"].clone();
        server.apply(json!({
            "metadata": metadata,
            "spec": template["spec"],
            "status": {
                "phase": "Running",
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }));
    }
    // The proxy runs in the manifests' namespace: its kubeconfig context stands for it.
    let dir = TempDir::new("manifests");
    let kubeconfig = dir.path().join("kubeconfig");
    let namespace = kind(&manifests("proxy.yaml"), "Deployment")["metadata"]["namespace"]
        .as_str()
        .unwrap()
        .to_owned();
    std::fs::write(&kubeconfig, server.kubeconfig(&namespace)).unwrap();
    config.client = ClientConfig::Kubeconfig(kubeconfig);
    let merged = MergedSource::builder()
        .source(kubernetes::spawn(config).await.unwrap())
        .build();
    let set = wait_for(&merged, Duration::from_secs(20), "both engines", |s| {
        s.by_role(Role::Prefill).len() == 1 && s.by_role(Role::Decode).len() == 1
    })
    .await;
    assert_eq!(ids(&set, Role::Prefill), ["http://127.0.3.1:8100"]);
    assert_eq!(ids(&set, Role::Decode), ["http://127.0.4.1:8200"]);
    for (endpoint, ip) in [
        (&set.by_role(Role::Prefill)[0], "127.0.3.1"),
        (&set.by_role(Role::Decode)[0], "127.0.4.1"),
    ] {
        assert!(crate::support::serves(endpoint, "llama-3.1-8b-instruct"));
        let profile = endpoint.ext().get::<KvProfile>().unwrap();
        assert_eq!(profile.connector.as_deref(), Some("NixlConnector"));
        assert_eq!(profile.role, Some(KvRole::Both));
        assert_eq!(profile.tp_size, Some(1));
        assert_eq!(
            endpoint.ext().get::<KvEventsEndpoint>(),
            Some(&KvEventsEndpoint(format!("tcp://{ip}:5557")))
        );
    }
    assert_eq!(merged.snapshot().by_role(Role::Prefill).len(), 1);
    assert_eq!(merged.sources().next().unwrap().1.rejected(), 0);
}
