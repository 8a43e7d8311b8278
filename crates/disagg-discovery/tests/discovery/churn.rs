//! Hot changes drop nothing, on the request path: the proxy (orchestrator and HTTP
//! service) routes over a `MergedSource` whose engines are added and removed every
//! 100 ms for 5 s (50 changes, each met by the 64 streams then in flight) while 64
//! clients stream answers without pause. Every request must
//! succeed and every stream end with `[DONE]`; afterwards no request is counted in
//! flight anywhere, and every decode took its KV from a prefill (simulated vLLM
//! engines speaking NIXL over real loopback sockets).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use disagg_connectors::vllm::VllmNixl;
use disagg_core::{EndpointSource, Orchestrator, Role};
use disagg_discovery::{EndpointSpec, MergedSource, SpecSource};
use disagg_http::{HttpTransport, PdService};
use disagg_sim::{SimConfig, SimEngine};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

const CLIENTS: usize = 64;
const CHURN_EVERY: Duration = Duration::from_millis(100);
const CHURN_FOR: Duration = Duration::from_secs(5);

/// A small deterministic generator (xorshift64*), so that a failing run repeats.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A non-empty subset of `0..n`, as a bit mask.
    fn subset(&mut self, n: u32) -> u64 {
        loop {
            let mask = self.next() & ((1 << n) - 1);
            if mask != 0 {
                return mask;
            }
        }
    }
}

fn specs(engines: &[SimEngine], role: Role, mask: u64) -> Vec<EndpointSpec> {
    engines
        .iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0)
        .map(|(_, e)| EndpointSpec::new(e.url(), role))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_added_and_removed_under_load_fail_no_request() {
    let config = || SimConfig {
        // About 100 ms a stream: many streams span a change of the set.
        inter_token_delay: Duration::from_millis(5),
        ..SimConfig::default()
    };
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for _ in 0..4 {
        prefill.push(SimEngine::start(config()).await.unwrap());
        decode.push(SimEngine::start(config()).await.unwrap());
    }
    // Every engine is discovered: a set that passed through an empty (or partial)
    // state between two lists would fail requests with 503.
    let (publisher, discovered) = SpecSource::channel("churn");
    let merged = Arc::new(MergedSource::builder().source(discovered).build());
    let orchestrator = Orchestrator::builder(
        Arc::clone(&merged),
        HttpTransport::default(),
        VllmNixl::new(),
    )
    .build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/v1/chat/completions",
        listener.local_addr().unwrap()
    );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(disagg_http::server::Builder::new().serve(
        listener,
        PdService::new(orchestrator),
        async {
            let _ = stop_rx.await;
        },
    ));

    publisher.publish(
        specs(&prefill, Role::Prefill, 0b1111)
            .into_iter()
            .chain(specs(&decode, Role::Decode, 0b1111))
            .collect(),
    );
    merged.synced().await;

    let done = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let (client, url, done, ok) = (
            client.clone(),
            url.clone(),
            Arc::clone(&done),
            Arc::clone(&ok),
        );
        clients.push(tokio::spawn(async move {
            let mut n = 0;
            while !done.load(Ordering::Relaxed) {
                let body = serde_json::json!({
                    "model": "sim-model",
                    "messages": [{"role": "user", "content": format!("client {c} request {n}")}],
                    "max_tokens": 20,
                    "stream": true,
                });
                let req = http::Request::post(&url)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body.to_string())))
                    .unwrap();
                let res = client.request(req).await.expect("the proxy answers");
                let status = res.status();
                let body = res
                    .into_body()
                    .collect()
                    .await
                    .expect("the whole stream")
                    .to_bytes();
                let text = String::from_utf8_lossy(&body);
                assert_eq!(status, 200, "client {c} request {n}: {text}");
                assert!(
                    text.trim_end().ends_with("data: [DONE]") && !text.contains("\"error\""),
                    "client {c} request {n}: an incomplete stream: {text}"
                );
                ok.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
        }));
    }

    // The churn: every 100 ms a new random (non-empty) subset of the engines.
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut changes = 0u32;
    let start = tokio::time::Instant::now();
    while start.elapsed() < CHURN_FOR {
        let p = rng.subset(4);
        let d = rng.subset(4);
        let mut list = specs(&prefill, Role::Prefill, p);
        list.extend(specs(&decode, Role::Decode, d));
        if publisher.publish(list) {
            changes += 1;
        }
        tokio::time::sleep(CHURN_EVERY).await;
    }
    done.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.expect("a client failed a request");
    }
    let _ = stop_tx.send(());

    let requests = ok.load(Ordering::Relaxed);
    assert!(changes >= 30, "the set changed {changes} times");
    assert!(requests >= CLIENTS as u64, "{requests} requests");
    let stats = merged.sources().find(|(n, _)| *n == "churn").unwrap().1;
    assert!(stats.added() > 0 && stats.removed() > 0);
    // Nothing counted in flight: every guard went with its stream, on the endpoints
    // still in the set as on those that left.
    let set = merged.snapshot();
    for e in set
        .by_role(Role::Prefill)
        .iter()
        .chain(set.by_role(Role::Decode))
    {
        assert_eq!(e.in_flight(), 0, "{}", e.id());
    }
    // Every answer was a real handoff: each decode pulled the KV its prefill made.
    let prefills: u64 = prefill.iter().map(|e| e.stats().kv_params_returned).sum();
    let decodes: u64 = decode.iter().map(|e| e.stats().remote_decodes).sum();
    let failures: u64 = decode.iter().map(|e| e.stats().kv_pull_failures).sum();
    assert_eq!((prefills, decodes, failures), (requests, requests, 0));
    // Every engine took its share.
    assert!(decode.iter().all(|e| e.stats().remote_decodes > 0));
    assert!(prefill.iter().all(|e| e.stats().kv_params_returned > 0));
}
