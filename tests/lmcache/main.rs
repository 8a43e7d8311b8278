//! The LMCache connector end to end: 2 prefill and 2 decode simulated engines (decode TP
//! 2) speaking LMCache over real loopback sockets (HTTP, the KV push to the decodes'
//! receiver ports, the ZMQ notifications to the proxy), against a plain engine's direct
//! answers.

#[path = "../support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use disagg_affinity::{PerLeg, RoundRobin};
use disagg_connectors::lmcache::{Lmcache, LmcacheReceiver, Notifications, NotifyConfig};
use disagg_core::orchestrator::OrchestratorConfig;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::HttpTransport;
use disagg_sim::{Faults, KvMode, SimConfig, SimEngine, SimRole};
use serde_json::json;
use support::{Answer, assert_openai_error, eventually, post};

/// POST `body` and read the whole answer.
async fn ask(base: &str, path: &str, body: &str) -> Answer {
    post(base, path, body.to_owned(), &[]).await
}

const TP: usize = 2;

/// The proxy with the LMCache connector over 2P2D, and a plain engine for direct runs.
struct Lm {
    url: String,
    prefill: Vec<SimEngine>,
    decode: Vec<SimEngine>,
    direct: SimEngine,
    notifications: Notifications,
    orchestrator: Orchestrator,
    _stop: tokio::sync::oneshot::Sender<()>,
}

struct Opts {
    handoff_timeout: Duration,
    kv_lease: Duration,
    /// Decode receivers as the proxy knows them (`None`: the engines' real ports).
    receivers: Option<Vec<LmcacheReceiver>>,
    /// Hold every byte from a prefill engine back this long on its way to the proxy
    /// (a slow network on the HTTP path only; the notifications go straight).
    prefill_answer_delay: Option<Duration>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            handoff_timeout: Duration::from_secs(5),
            kv_lease: Duration::from_secs(30),
            receivers: None,
            prefill_answer_delay: None,
        }
    }
}

async fn start(opts: Opts) -> Lm {
    let notifications = Notifications::bind("127.0.0.1:0", NotifyConfig::default())
        .await
        .expect("bind the notification socket");
    let zmq = notifications.local_addr().expect("bound address");
    let mut decode = Vec::new();
    for _ in 0..2 {
        let c = SimConfig {
            kv_mode: KvMode::Lmcache(SimRole::Decode),
            lmcache_receiver: disagg_sim::LmcacheReceiver::ephemeral(TP),
            kv_lease: opts.kv_lease,
            ..SimConfig::default()
        };
        decode.push(SimEngine::start(c).await.expect("start decode"));
    }
    let mut prefill = Vec::new();
    for i in 0..2 {
        let c = SimConfig {
            kv_mode: KvMode::Lmcache(SimRole::Prefill),
            lmcache_proxy: Some(zmq.to_string()),
            notify_seed: i,
            ..SimConfig::default()
        };
        prefill.push(SimEngine::start(c).await.expect("start prefill"));
    }
    let direct = SimEngine::start(SimConfig::default())
        .await
        .expect("direct");

    let mut endpoints = Vec::new();
    for p in &prefill {
        let url = match opts.prefill_answer_delay {
            Some(d) => format!("http://{}", delaying_relay(p.addr(), d).await),
            None => p.url(),
        };
        endpoints.push(Endpoint::new(&url, Role::Prefill).unwrap());
    }
    for (i, d) in decode.iter().enumerate() {
        let receiver = match &opts.receivers {
            Some(r) => r[i].clone(),
            None => {
                LmcacheReceiver::new("127.0.0.1", d.lmcache_init_ports(), d.lmcache_alloc_ports())
                    .unwrap()
            }
        };
        let facts = disagg_core::endpoint::Facts::default()
            .with(
                disagg_core::endpoint::Facts::KV_RECEIVER,
                receiver.to_string(),
            )
            .unwrap();
        endpoints.push(
            Endpoint::new(&d.url(), Role::Decode)
                .unwrap()
                .with_facts(facts),
        );
    }
    let mut config = OrchestratorConfig::default();
    config.handoff_timeout = opts.handoff_timeout;
    let orchestrator = Orchestrator::builder(
        Arc::new(StaticSource::new(endpoints)),
        HttpTransport::default(),
        Lmcache::new(notifications.clone()),
    )
    .router(PerLeg::both(RoundRobin::new))
    .config(config)
    .build();
    let (url, stop) = support::serve_proxy(orchestrator.clone()).await;
    Lm {
        url,
        prefill,
        decode,
        direct,
        notifications,
        orchestrator,
        _stop: stop,
    }
}

/// A TCP relay to `upstream` that forwards what the client sends at once and holds
/// every read from `upstream` back by `delay`.
async fn delaying_relay(upstream: std::net::SocketAddr, delay: Duration) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = tokio::io::copy(&mut cr, &mut sw);
                let down = async {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = sr.read(&mut buf).await?;
                        if n == 0 {
                            return cw.shutdown().await;
                        }
                        tokio::time::sleep(delay).await;
                        cw.write_all(&buf[..n]).await?;
                    }
                };
                let _ = tokio::join!(up, down);
            });
        }
    });
    addr
}

impl Lm {
    fn set_prefill_faults(&self, faults: Faults) {
        for p in &self.prefill {
            p.set_faults(faults);
        }
    }

    /// Whether the decodes soon hold no KV.
    async fn kv_drains(&self) -> bool {
        let decodes = &self.decode;
        eventually(Duration::from_secs(5), || {
            decodes.iter().all(|d| d.stats().blocks_held == 0)
        })
        .await
    }

    fn decode_requests(&self) -> u64 {
        self.decode.iter().map(|d| d.stats().requests).sum()
    }
}

fn chat_body(content: &str, max_tokens: u32, stream: bool) -> String {
    json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}

fn completion_body(prompt: &str, max_tokens: u32, stream: bool) -> String {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
        .to_string()
}

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// The same request through the proxy and straight to a plain engine: same text, same
/// finish, and the client's own form (object, chunks, usage).
async fn same_as_direct(lm: &Lm, path: &str, body: &str) -> Answer {
    let via = ask(&lm.url, path, body).await;
    let direct = ask(&lm.direct.url(), path, body).await;
    assert_eq!(via.status, 200, "{}", via.text());
    assert_eq!(direct.status, 200, "{}", direct.text());
    assert_eq!(via.header("x-disagg-handoff"), Some("kv"), "{}", via.text());
    assert_eq!(via.content(), direct.content(), "{path} {body}");
    assert!(!via.content().is_empty());
    let stream = body.contains("\"stream\":true");
    if stream {
        let events = via.events();
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let object = if path == CHAT {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        assert!(chunks.iter().all(|c| c["object"] == object), "{events:?}");
        let ids: std::collections::HashSet<_> = chunks.iter().map(|c| c["id"].clone()).collect();
        assert_eq!(ids.len(), 1, "one id for every chunk: {events:?}");
        let finish = |a: &Answer| {
            a.events()
                .iter()
                .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
                .filter_map(|c| c["choices"][0]["finish_reason"].as_str().map(str::to_owned))
                .collect::<Vec<_>>()
        };
        assert_eq!(finish(&via), finish(&direct));
    } else {
        let (v, d) = (via.json(), direct.json());
        assert_eq!(v["object"], d["object"]);
        assert_eq!(
            v["choices"][0]["finish_reason"],
            d["choices"][0]["finish_reason"]
        );
        assert_eq!(
            v["usage"], d["usage"],
            "usage counts the prompt and each token once"
        );
    }
    via
}

#[tokio::test]
async fn chat_and_completions_streamed_or_not_equal_a_direct_run() {
    let lm = start(Opts::default()).await;
    for i in 0..4 {
        let prompt = format!("tell me about lmcache number {i} please");
        same_as_direct(&lm, CHAT, &chat_body(&prompt, 12, false)).await;
        same_as_direct(&lm, CHAT, &chat_body(&prompt, 12, true)).await;
        same_as_direct(&lm, COMPLETIONS, &completion_body(&prompt, 12, false)).await;
        same_as_direct(&lm, COMPLETIONS, &completion_body(&prompt, 12, true)).await;
    }
    // 16 requests over 2P2D, round robin: every engine served, every decode's KV taken.
    for p in &lm.prefill {
        assert_eq!(p.stats().prefill_requests, 8);
    }
    for d in &lm.decode {
        let s = d.stats();
        assert!(s.requests > 0, "{s:?}");
        assert_eq!(s.kv_missing, 0, "{s:?}");
        assert_eq!(s.blocks_held, 0, "{s:?}");
    }
    assert_eq!(lm.notifications.pending_len(), 0);
    let n = lm.notifications.stats();
    assert_eq!(n.completed, 16, "{n:?}");
    assert_eq!(
        n.matched,
        16 * TP as u64,
        "one notification per decode TP rank: {n:?}"
    );
}

#[tokio::test]
async fn a_streamed_answer_starts_with_the_first_token_before_the_kv_is_ready() {
    let lm = start(Opts::default()).await;
    // Notifications come 400 ms after the prefill's answer.
    lm.set_prefill_faults(Faults {
        notify_delay: Duration::from_millis(400),
        ..Faults::default()
    });
    let body = chat_body("first token early", 8, true);
    let started = Instant::now();
    let resp = support::client()
        .request(
            http::Request::post(format!("{}{CHAT}", lm.url))
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(body.clone())))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    use http_body_util::BodyExt;
    let mut body_stream = resp.into_body();
    let first = body_stream
        .frame()
        .await
        .unwrap()
        .unwrap()
        .into_data()
        .unwrap();
    let first_at = started.elapsed();
    // The first frame: the role-only chunk, then the first token's.
    let lead = support::sse_payloads(&first);
    assert_eq!(lead.len(), 2, "{lead:?}");
    let role: serde_json::Value = serde_json::from_str(&lead[0]).unwrap();
    assert_eq!(role["choices"][0]["delta"]["role"], "assistant");
    let first: serde_json::Value = serde_json::from_str(&lead[1]).unwrap();
    let rest = body_stream.collect().await.unwrap().to_bytes();
    let total = started.elapsed();
    assert!(
        first_at < Duration::from_millis(300),
        "the first chunk waited for the KV: {first_at:?}"
    );
    assert!(total >= Duration::from_millis(400), "{total:?}");
    let direct = ask(&lm.direct.url(), CHAT, &body).await;
    let mut text = first["choices"][0]["delta"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    for e in support::sse_payloads(&rest) {
        if e.as_str() == "[DONE]" {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&e).unwrap();
        text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    assert_eq!(text, direct.content());
}

#[tokio::test]
async fn notifications_before_the_prefills_answer_are_not_lost() {
    // The prefill's HTTP answer reaches the proxy 300 ms late, its notifications (sent as
    // each rank's push is acknowledged, before the answer is written) at once: they
    // come first, and the registration made before the prefill leg catches them.
    let lm = start(Opts {
        prefill_answer_delay: Some(Duration::from_millis(300)),
        ..Opts::default()
    })
    .await;
    for i in 0..4 {
        let a = same_as_direct(
            &lm,
            COMPLETIONS,
            &completion_body(&format!("early {i}"), 6, false),
        )
        .await;
        // No wait between the prefill's answer and the decode leg: the KV was ready.
        let handoff_ms = server_timing(&a, "handoff").expect("handoff timing");
        assert!(
            handoff_ms < 150.0,
            "waited {handoff_ms} ms for notifications"
        );
    }
    let n = lm.notifications.stats();
    assert_eq!(n.completed, 4, "{n:?}");
    assert_eq!(
        n.unknown, 0,
        "no notification came before its registration: {n:?}"
    );
}

/// A `server-timing` metric's duration, in ms.
fn server_timing(a: &Answer, name: &str) -> Option<f64> {
    a.header("server-timing")?.split(',').find_map(|m| {
        let (n, rest) = m.trim().split_once(';')?;
        (n == name).then(|| rest.trim().strip_prefix("dur=")?.parse().ok())?
    })
}

#[tokio::test]
async fn a_lost_notification_times_out_in_bounded_time() {
    let lm = start(Opts {
        handoff_timeout: Duration::from_millis(300),
        kv_lease: Duration::from_millis(500),
        ..Opts::default()
    })
    .await;
    lm.set_prefill_faults(Faults {
        notify_loss: 1.0,
        ..Faults::default()
    });
    let started = Instant::now();
    let a = ask(&lm.url, CHAT, &chat_body("lost", 8, false)).await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_openai_error(&a, 504, "handoff_timeout");
    // Streamed: the first token went out, then the stream ends with the error event.
    let a = ask(&lm.url, CHAT, &chat_body("lost", 8, true)).await;
    assert_eq!(a.status, 200);
    let events = a.events();
    let first: serde_json::Value = serde_json::from_str(&events[0]).unwrap();
    assert!(
        first["choices"][0]["delta"]["content"].is_string(),
        "{events:?}"
    );
    let last: serde_json::Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "handoff_timeout", "{events:?}");
    assert_eq!(lm.decode_requests(), 0, "no decode leg without the KV");
    assert_eq!(lm.notifications.pending_len(), 0);
    // The KV pushed for nothing expires on the decodes.
    assert!(
        lm.kv_drains().await,
        "the KV pushed for nothing expires on the decodes"
    );
}

#[tokio::test]
async fn duplicate_and_unknown_notifications_are_ignored() {
    let lm = start(Opts::default()).await;
    lm.set_prefill_faults(Faults {
        notify_duplicates: 2,
        ..Faults::default()
    });
    // A stranger's notifications, for ids nobody registered.
    let mut push = zeromq::PushSocket::new();
    use zeromq::{Socket, SocketSend};
    push.connect(&format!("tcp://{}", lm.notifications.local_addr().unwrap()))
        .await
        .unwrap();
    for i in 0..5 {
        let msg =
            rmp_serde::to_vec_named(&json!({"type": "ProxyNotif", "req_id": format!("x{i}")}))
                .unwrap();
        push.send(zeromq::ZmqMessage::from(msg)).await.unwrap();
    }
    for i in 0..6 {
        same_as_direct(&lm, CHAT, &chat_body(&format!("dup {i}"), 6, i % 2 == 0)).await;
    }
    let lm_ref = &lm;
    assert!(
        eventually(Duration::from_secs(5), || lm_ref
            .notifications
            .stats()
            .unknown
            >= 5)
        .await,
        "{:?}",
        lm.notifications.stats()
    );
    let n = lm.notifications.stats();
    assert_eq!(n.completed, 6, "{n:?}");
    assert!(
        n.extra + n.unknown >= 6 * 2 * TP as u64,
        "duplicates were counted: {n:?}"
    );
    assert_eq!(lm.notifications.pending_len(), 0);
}

#[tokio::test]
async fn a_first_token_that_ends_the_answer_sends_no_decode_leg() {
    let lm = start(Opts::default()).await;
    for stream in [false, true] {
        let body = chat_body("just one", 1, stream);
        let via = ask(&lm.url, CHAT, &body).await;
        let direct = ask(&lm.direct.url(), CHAT, &body).await;
        assert_eq!(via.status, 200, "{}", via.text());
        assert_eq!(via.header("x-disagg-handoff"), Some("prefill"));
        assert_eq!(via.content(), direct.content());
        if stream {
            assert_eq!(via.events().last().map(String::as_str), Some("[DONE]"));
        } else {
            assert_eq!(via.json()["usage"], direct.json()["usage"]);
        }
    }
    assert_eq!(lm.decode_requests(), 0);
    assert_eq!(lm.notifications.pending_len(), 0);
}

#[tokio::test]
async fn a_wrong_receiver_port_really_fails() {
    // The probe's decodes keep their receivers (and so their ports) to the end: no
    // engine started below can take them.
    let probe = start(Opts::default()).await;
    // The proxy believes in swapped init and alloc ports.
    let receivers = probe
        .decode
        .iter()
        .map(|d| {
            LmcacheReceiver::new("127.0.0.1", d.lmcache_alloc_ports(), d.lmcache_init_ports())
                .unwrap()
        })
        .collect();
    let lm = start(Opts {
        receivers: Some(receivers),
        ..Opts::default()
    })
    .await;
    let a = ask(&lm.url, CHAT, &chat_body("wrong port", 4, false)).await;
    assert_openai_error(&a, 502, "prefill_failed");
    assert_eq!(lm.decode_requests(), 0);
    assert_eq!(lm.notifications.pending_len(), 0);
    // The probe's receivers refused the swapped ports (each is of the other kind).
    assert_eq!(
        probe
            .decode
            .iter()
            .map(|d| d.stats().kv_received)
            .sum::<u64>(),
        0
    );
}

/// 1% of the notifications lost: exactly the requests that lost one time out (a budget
/// long enough that no other request runs out of it on a loaded machine), every other
/// one is answered, and nothing is left pending on the proxy or held on the decodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_requests_with_lost_notifications_leave_nothing_pending() {
    let lm = start(Opts {
        handoff_timeout: Duration::from_secs(1),
        // Longer than the handoff budget, as in a deployment: KV pushed for a request
        // whose notification only came late is still there for its decode leg.
        kv_lease: Duration::from_secs(2),
        ..Opts::default()
    })
    .await;
    lm.set_prefill_faults(Faults {
        notify_loss: 0.01,
        ..Faults::default()
    });
    const N: usize = 2_000;
    const CONCURRENCY: usize = 32;
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..CONCURRENCY {
        let (url, next) = (lm.url.clone(), Arc::clone(&next));
        workers.push(tokio::spawn(async move {
            let (mut ok, mut timed_out) = (0usize, 0usize);
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= N {
                    return (ok, timed_out);
                }
                let body = completion_body(&format!("soak {i}"), 3, i % 4 == 0);
                let f = support::fetch(&url, COMPLETIONS, body).await;
                let text = match &f.body {
                    Ok(b) => String::from_utf8_lossy(b).into_owned(),
                    Err(e) => panic!("request {i}: body broke: {e}"),
                };
                if f.status == 504 || text.contains("handoff_timeout") {
                    timed_out += 1;
                } else {
                    assert_eq!(f.status, 200, "{text}");
                    ok += 1;
                }
            }
        }));
    }
    let (mut ok, mut timed_out) = (0, 0);
    for w in workers {
        let (o, t) = w.await.unwrap();
        ok += o;
        timed_out += t;
    }
    assert_eq!(ok + timed_out, N);
    // Each request sends one notification per rank (TP 2): a request that lost one or
    // both timed out, and no other did.
    let lost: u64 = lm
        .prefill
        .iter()
        .map(|p| p.stats().notifications_lost)
        .sum();
    let timed_out = timed_out as u64;
    assert!(
        timed_out > 0,
        "1% loss on 2 ranks lost nothing in {N} requests?"
    );
    assert!(
        timed_out <= lost && lost <= TP as u64 * timed_out,
        "{timed_out} of {N} requests timed out, {lost} notifications were lost"
    );
    assert_eq!(
        lm.notifications.pending_len(),
        0,
        "the pending map is empty"
    );
    assert_eq!(lm.orchestrator.stats().in_flight, 0);
    assert!(
        lm.kv_drains().await,
        "KV of the timed-out requests expires on the decodes"
    );
}

/// The first chunks a client sees, event by event and field by field, with the
/// simulator's own (vLLM 0.33's form), `id` and `created` aside.
#[tokio::test]
async fn the_first_chunks_are_the_ones_vllm_streams() {
    let lm = start(Opts::default()).await;
    let fields = |e: &str| -> serde_json::Value {
        let mut v: serde_json::Value = serde_json::from_str(e).unwrap();
        let o = v.as_object_mut().unwrap();
        assert!(o.remove("id").is_some_and(|id| id.is_string()), "{e}");
        assert!(o.remove("created").is_some_and(|c| c.is_u64()), "{e}");
        v
    };
    for (path, body, lead) in [
        (CHAT, chat_body("the first chunk of a chat", 6, true), 2),
        (
            COMPLETIONS,
            completion_body("the first chunk of a completion", 6, true),
            1,
        ),
    ] {
        let via = ask(&lm.url, path, &body).await;
        let direct = ask(&lm.direct.url(), path, &body).await;
        assert_eq!(via.header("x-disagg-handoff"), Some("kv"));
        let (v, d) = (via.events(), direct.events());
        // The proxy's own chunks (the role chunk for chat, then the first token's),
        // and the decode's first after them.
        for i in 0..=lead {
            assert_eq!(fields(&v[i]), fields(&d[i]), "{path} chunk {i}");
        }
        // The last token's chunk too: its finish, `stop_reason` and the rest.
        let last = |e: &[String]| fields(&e[e.len() - 2]);
        assert_eq!(last(&v), last(&d), "{path} last chunk");
    }
}
