//! LMCache P/D (`KvMode::Lmcache`): `/tokenize`, token-id prompts, the KV
//! push to a decode's receiver ports and the ZMQ `ProxyNotif` notifications,
//! over real loopback sockets, with a ZMQ `PULL` socket of the test as the
//! proxy.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use disagg_sim::{
    Faults, KvMode, LmcacheReceiver, SimConfig, SimEngine, SimRole, generate, tokenize,
};
use serde_json::{Value, json};
use zeromq::{PullSocket, Socket, SocketEvent, SocketRecv};

const COMPLETIONS: &str = "/v1/completions";
const PROMPT: &str = "the quick brown fox jumps over the lazy dog again and again";

/// The test's stand-in for the proxy: a ZMQ PULL socket.
struct Proxy {
    pull: PullSocket,
    addr: String,
    events: futures::channel::mpsc::Receiver<SocketEvent>,
}

async fn proxy() -> Proxy {
    let mut pull = PullSocket::new();
    let events = pull.monitor();
    let endpoint = pull.bind("tcp://127.0.0.1:0").await.unwrap();
    let addr = endpoint.to_string().trim_start_matches("tcp://").to_owned();
    Proxy { pull, addr, events }
}

impl Proxy {
    /// The `req_id` of the next notification, if one arrives within `wait`.
    async fn next(&mut self, wait: Duration) -> Option<String> {
        let message = tokio::time::timeout(wait, self.pull.recv())
            .await
            .ok()?
            .unwrap();
        assert_eq!(message.len(), 1, "a notification is a single frame");
        let frame = message.get(0).unwrap();
        let map: HashMap<String, String> = rmp_serde::from_slice(frame).unwrap();
        assert_eq!(map.len(), 2, "{map:?}");
        assert_eq!(map["type"], "ProxyNotif");
        Some(map["req_id"].clone())
    }

    /// Every notification arriving within `wait` of each other.
    async fn drain(&mut self, wait: Duration) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(id) = self.next(wait).await {
            out.push(id);
        }
        out
    }

    /// Connections the PULL socket accepted so far.
    fn accepted(&mut self) -> usize {
        let mut n = 0;
        while let Ok(event) = self.events.try_recv() {
            if matches!(event, SocketEvent::Accepted(..)) {
                n += 1;
            }
        }
        n
    }
}

async fn prefill_with(proxy: Option<&str>, faults: Faults) -> SimEngine {
    SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Prefill),
        lmcache_proxy: proxy.map(str::to_owned),
        faults,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

async fn prefill(proxy: &Proxy) -> SimEngine {
    prefill_with(Some(&proxy.addr), Faults::default()).await
}

async fn decode_with(tp: usize, lease: Duration) -> SimEngine {
    SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Decode),
        lmcache_receiver: LmcacheReceiver::ephemeral(tp),
        kv_lease: lease,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

async fn decode(tp: usize) -> SimEngine {
    decode_with(tp, Duration::from_secs(30)).await
}

/// A `disagg_spec` naming every receiver rank of `d`.
fn spec(req_id: &str, d: &SimEngine) -> Value {
    spec_to(
        req_id,
        "127.0.0.1",
        d.lmcache_init_ports(),
        d.lmcache_alloc_ports(),
    )
}

fn spec_to(req_id: &str, host: &str, init: Vec<u16>, alloc: Vec<u16>) -> Value {
    json!({
        "req_id": req_id,
        "receiver_host": host,
        "receiver_init_port": init,
        "receiver_alloc_port": alloc,
        "is_last_prefill": true,
    })
}

/// The prefill leg as the proxy sends it.
fn prefill_body(ids: &[u32], spec: Value) -> Value {
    json!({
        "model": "sim-model",
        "prompt": ids,
        "max_tokens": 1,
        "stream": false,
        "kv_transfer_params": {"ret_first_tok": true, "disagg_spec": spec},
    })
}

async fn tokenize_on(e: &SimEngine, body: &Value) -> Vec<u32> {
    let reply = post(e.addr(), "/tokenize", body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let v = reply.json();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
        .collect()
}

fn error_message(reply: &Reply) -> String {
    let v = reply.json();
    assert_eq!(v["error"]["code"], reply.status, "{v}");
    assert!(
        v["error"]["type"].as_str().unwrap().ends_with("Error"),
        "{v}"
    );
    v["error"]["message"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn tokenize_text_and_messages() {
    let nixl = SimEngine::start(SimConfig::default()).await.unwrap();
    let d = decode(1).await;
    for e in [&nixl, &d] {
        let reply = post(
            e.addr(),
            "/tokenize",
            &json!({"model": "sim-model", "prompt": PROMPT}),
        )
        .await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.headers["content-type"], "application/json");
        let ids = tokenize(PROMPT);
        assert_eq!(
            reply.json(),
            json!({"count": ids.len(), "max_model_len": 8192, "tokens": ids, "token_strs": null})
        );

        let messages = json!([
            {"role": "system", "content": "You are"},
            {"role": "user", "content": [{"type": "text", "text": "a  helpful\nbot"}]}
        ]);
        let chat_ids = tokenize_on(
            e,
            &json!({"messages": messages, "add_generation_prompt": true}),
        )
        .await;
        assert_eq!(chat_ids, tokenize("You are a helpful bot"));
        assert_eq!(
            tokenize_on(e, &json!({"messages": messages})).await,
            chat_ids
        );
        assert_eq!(
            tokenize_on(e, &json!({"prompt": ""})).await,
            Vec::<u32>::new()
        );
    }

    for (body, status, needle) in [
        (json!({"prompt": 17}), 400, "prompt"),
        (json!({}), 400, "prompt: Field required"),
        (json!({"messages": "hi"}), 400, "messages"),
        (json!({"messages": [1]}), 400, "messages"),
        (
            json!({"messages": [], "add_generation_prompt": "maybe"}),
            400,
            "add_generation_prompt",
        ),
        (json!({"model": "gpt-9", "prompt": "x"}), 404, "gpt-9"),
    ] {
        let reply = post(d.addr(), "/tokenize", &body).await;
        assert_eq!(reply.status, status, "{body}");
        assert!(
            error_message(&reply).contains(needle),
            "{body}: {}",
            reply.text()
        );
    }
    let reply = request(d.addr(), "POST", "/tokenize", &[], Some(b"{nope".to_vec())).await;
    assert_eq!(reply.status, 400);
    // Tokenizing is not a completion request.
    let stats = d.stats();
    assert_eq!(stats.tokenize_requests, 11);
    assert_eq!(stats.requests, 0);
}

#[tokio::test]
async fn token_ids_are_first_class_prompts() {
    let e = SimEngine::start(SimConfig::default()).await.unwrap();
    let ids = tokenize_on(&e, &json!({"prompt": PROMPT})).await;
    let by_text = post(
        e.addr(),
        COMPLETIONS,
        &json!({"prompt": PROMPT, "max_tokens": 7}),
    )
    .await;
    let by_ids = post(
        e.addr(),
        COMPLETIONS,
        &json!({"prompt": ids, "max_tokens": 7}),
    )
    .await;
    assert_eq!(by_text.status, 200);
    assert_eq!(by_ids.status, 200);
    let (t, i) = (by_text.json(), by_ids.json());
    assert_eq!(t["choices"], i["choices"]);
    assert_eq!(t["usage"], i["usage"]);
    assert_eq!(t["choices"][0]["text"], generate(PROMPT, 7, 0).concat());

    // Chat == completions on the tokenized messages.
    let messages = json!([
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Where is the lazy dog?"}
    ]);
    let chat = post(
        e.addr(),
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 6}),
    )
    .await
    .json();
    let chat_ids = tokenize_on(
        &e,
        &json!({"messages": messages, "add_generation_prompt": true}),
    )
    .await;
    let completion = post(
        e.addr(),
        COMPLETIONS,
        &json!({"prompt": chat_ids, "max_tokens": 6}),
    )
    .await
    .json();
    assert_eq!(
        chat["choices"][0]["message"]["content"],
        completion["choices"][0]["text"]
    );
    assert_eq!(chat["usage"], completion["usage"]);

    // Ids outside the vocabulary are rejected, like vLLM.
    let reply = post(
        e.addr(),
        COMPLETIONS,
        &json!({"prompt": [17, disagg_sim::VOCAB_SIZE], "max_tokens": 1}),
    )
    .await;
    assert_eq!(reply.status, 400);
    assert!(error_message(&reply).contains("out of vocabulary"));
}

/// The decode leg the proxy sends once the prefill answered: `ids` and then `first_tok`.
async fn decode_after(d: &SimEngine, ids: &[u32], first_tok: u64, max_tokens: u32) -> Reply {
    let mut prompt: Vec<u64> = ids.iter().map(|&i| u64::from(i)).collect();
    prompt.push(first_tok);
    post(
        d.addr(),
        COMPLETIONS,
        &json!({"prompt": prompt, "max_tokens": max_tokens}),
    )
    .await
}

/// One request through a 1P1D pair by hand, as the proxy does it; returns
/// the first token's text, the decode's reply and the first token id.
async fn one_request(
    proxy: &mut Proxy,
    p: &SimEngine,
    d: &SimEngine,
    req_id: &str,
    max_tokens: u32,
    stream: bool,
) -> (String, Reply, u32) {
    let ids = tokenize_on(p, &json!({"prompt": PROMPT})).await;
    let reply = post(p.addr(), COMPLETIONS, &prefill_body(&ids, spec(req_id, d))).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let v = reply.json();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    assert_eq!(v["usage"]["completion_tokens"], 1);
    let first_text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    let first_tok = u32::try_from(v["kv_transfer_params"]["first_tok"].as_u64().unwrap()).unwrap();
    assert_eq!(v["kv_transfer_params"], json!({"first_tok": first_tok}));
    // The first token's id is its tokenization.
    assert_eq!(tokenize(&first_text), [first_tok]);

    // One notification per decode rank, for this request.
    let ranks = d.lmcache_init_ports().len();
    for _ in 0..ranks {
        let got = proxy.next(Duration::from_secs(2)).await;
        assert_eq!(got.as_deref(), Some(req_id));
    }

    let mut decode_ids = ids.clone();
    decode_ids.push(first_tok);
    let mut body =
        json!({"model": "sim-model", "prompt": decode_ids, "max_tokens": max_tokens - 1});
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    let reply = post(d.addr(), COMPLETIONS, &body).await;
    (first_text, reply, first_tok)
}

#[tokio::test]
async fn one_prefill_one_decode_tp2_by_hand() {
    let mut proxy = proxy().await;
    let p = prefill(&proxy).await;
    let d = decode(2).await;
    assert_eq!(d.lmcache_init_ports().len(), 2);
    assert_eq!(d.lmcache_alloc_ports().len(), 2);
    assert!(p.lmcache_init_ports().is_empty());
    let n = 9;
    let direct = generate(PROMPT, n as usize, 0).concat();

    // Not streamed.
    let (first, reply, _) = one_request(&mut proxy, &p, &d, "req-1", n, false).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let v = reply.json();
    let rest = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(format!("{first}{rest}"), direct);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let prompt_len = tokenize(PROMPT).len() as u64;
    assert_eq!(v["usage"]["prompt_tokens"], prompt_len + 1);
    assert_eq!(v["usage"]["completion_tokens"], u64::from(n - 1));
    assert_eq!(v["kv_transfer_params"], Value::Null);

    // Streamed.
    let (first, reply, _) = one_request(&mut proxy, &p, &d, "req-2", n, true).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let events = reply.events();
    let rest: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(format!("{first}{rest}"), direct);
    let usage = events
        .iter()
        .find(|e| !e["usage"].is_null())
        .map(|e| e["usage"].clone())
        .unwrap();
    assert_eq!(usage["prompt_tokens"], prompt_len + 1);
    assert_eq!(usage["completion_tokens"], u64::from(n - 1));
    assert_eq!(events.last().unwrap(), "[DONE]");

    // Nothing more was sent, over one connection kept for both requests.
    assert_eq!(
        proxy.drain(Duration::from_millis(200)).await,
        Vec::<String>::new()
    );
    assert_eq!(proxy.accepted(), 1);

    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!(ps.prefill_requests, 2);
    assert_eq!(ps.kv_pushes, 4);
    assert_eq!(ps.notifications_sent, 4);
    assert_eq!(ps.blocks_held, 0);
    assert_eq!(ds.kv_received, 4);
    assert_eq!(ds.remote_decodes, 2);
    assert_eq!(ds.local_prefills, 0);
    assert_eq!(ds.kv_missing, 0);
    // Taken by the decodes.
    assert_eq!(ds.blocks_held, 0);

    // The KV was taken: the same decode again finds none and computes the prompt.
    let first_tok = u64::from(tokenize(&first)[0]);
    let before = d.stats();
    let again = decode_after(&d, &tokenize(PROMPT), first_tok, 3).await;
    assert_eq!(again.status, 200);
    let after = d.stats();
    assert_eq!(after.remote_decodes, before.remote_decodes);
    assert_eq!(after.local_prefills, before.local_prefills + 1);
}

#[tokio::test]
async fn decode_counts_min_and_max_tokens_on_its_own_output() {
    let mut proxy = proxy().await;
    let p = prefill(&proxy).await;
    let d = decode(1).await;
    let (first, reply, _) = one_request(&mut proxy, &p, &d, "short", 2, false).await;
    assert_eq!(reply.status, 200);
    let v = reply.json();
    assert_eq!(v["usage"]["completion_tokens"], 1);
    assert_eq!(
        format!("{first}{}", v["choices"][0]["text"].as_str().unwrap()),
        generate(PROMPT, 2, 0).concat()
    );
}

#[tokio::test]
async fn notifications_before_the_answer_or_after_the_delay() {
    let mut proxy = proxy().await;
    let p = prefill(&proxy).await;
    let d = decode(1).await;
    let ids = tokenize(PROMPT);

    // Delay 0: already there when the answer is (sent before it: read at once, unless
    // a loaded machine holds this test's thread; well before the 3 s delay below).
    let reply = post(p.addr(), COMPLETIONS, &prefill_body(&ids, spec("now", &d))).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        proxy.next(Duration::from_millis(500)).await.as_deref(),
        Some("now")
    );

    // A delay (set at run time): the answer first, the notification later.
    p.set_faults(Faults {
        notify_delay: Duration::from_secs(3),
        ..Faults::default()
    });
    let started = Instant::now();
    let reply = post(
        p.addr(),
        COMPLETIONS,
        &prefill_body(&ids, spec("later", &d)),
    )
    .await;
    assert_eq!(reply.status, 200);
    // Long before the delay (a bound with room for a loaded machine).
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(proxy.next(Duration::from_millis(200)).await, None);
    assert_eq!(
        proxy.next(Duration::from_secs(8)).await.as_deref(),
        Some("later")
    );
    assert!(started.elapsed() >= Duration::from_secs(3));
    // The KV itself was pushed before the answer.
    assert_eq!(d.stats().kv_received, 2);
}

#[tokio::test]
async fn wrong_receiver_address_fails_the_prefill_without_notification() {
    let mut proxy = proxy().await;
    let p = prefill(&proxy).await;
    let d = decode(2).await;
    let ids = tokenize(PROMPT);
    let (init, alloc) = (d.lmcache_init_ports(), d.lmcache_alloc_ports());
    let (dead, _held) = unused_port();
    let cases = [
        (
            "dead init port",
            spec_to("a", "127.0.0.1", vec![dead, init[1]], alloc.clone()),
        ),
        (
            "dead alloc port",
            spec_to("b", "127.0.0.1", init.clone(), vec![alloc[0], dead]),
        ),
        // Each port of the other kind: the receiver refuses the line.
        (
            "init port as alloc port",
            spec_to("c", "127.0.0.1", init.clone(), init.clone()),
        ),
        (
            "alloc port as init port",
            spec_to("d", "127.0.0.1", alloc.clone(), alloc.clone()),
        ),
        // Another rank's alloc port: the session of one rank is unknown to another.
        (
            "alloc ports swapped",
            spec_to("e", "127.0.0.1", init.clone(), vec![alloc[1], alloc[0]]),
        ),
        // Both lists swapped: each rank's KV lands on the other rank.
        (
            "ranks swapped",
            spec_to(
                "f",
                "127.0.0.1",
                vec![init[1], init[0]],
                vec![alloc[1], alloc[0]],
            ),
        ),
        // Nothing listens on 127.0.0.2: the receiver is bound to 127.0.0.1.
        (
            "wrong host",
            spec_to("g", "127.0.0.2", init.clone(), alloc.clone()),
        ),
    ];
    for (case, spec) in cases {
        let broken_ranks = spec["req_id"].as_str().map_or(0, |id| match id {
            "a" | "b" => 1,
            _ => 2,
        });
        let before = p.stats();
        let reply = post(p.addr(), COMPLETIONS, &prefill_body(&ids, spec)).await;
        assert_eq!(reply.status, 500, "{case}: {}", reply.text());
        let message = error_message(&reply);
        assert!(
            message.starts_with("KV transfer failed"),
            "{case}: {message}"
        );
        let after = p.stats();
        assert_eq!(
            after.kv_push_failures - before.kv_push_failures,
            broken_ranks,
            "{case}"
        );
        // Only the ranks whose push was acknowledged are notified.
        let notified = proxy.drain(Duration::from_millis(150)).await;
        assert_eq!(
            notified.len() as u64,
            2 - broken_ranks,
            "{case}: {notified:?}"
        );
    }
    // Only the good ranks of the first two cases received anything.
    assert_eq!(d.stats().kv_received, 2);
    assert_eq!(p.stats().kv_pushes, 2);
}

/// A decode request for a prompt whose KV was pushed to no rank is a cache miss to
/// LMCache, and vLLM computes the prompt itself (a request served on the decode alone).
#[tokio::test]
async fn decode_without_pushed_kv_computes_the_prompt_itself() {
    let d = decode(1).await;
    let ids = tokenize(PROMPT);
    for stream in [false, true] {
        let reply = post(
            d.addr(),
            COMPLETIONS,
            &json!({"prompt": ids, "max_tokens": 3, "stream": stream}),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let stats = d.stats();
    assert_eq!(stats.local_prefills, 2);
    assert_eq!(stats.remote_decodes, 0);
    assert_eq!(stats.kv_missing, 0);
}

/// A prefill whose spec names only rank 0 of a two-rank decode: the decode, the
/// prompt's ids, the prefill's answer and the blocks rank 0 holds once notified.
async fn kv_on_rank_0_of_2() -> (SimEngine, Vec<u32>, Value, u64) {
    let mut proxy = proxy().await;
    let p = prefill(&proxy).await;
    let d = decode(2).await;
    let ids = tokenize(PROMPT);
    let half = spec_to(
        "half",
        "127.0.0.1",
        vec![d.lmcache_init_ports()[0]],
        vec![d.lmcache_alloc_ports()[0]],
    );
    let reply = post(p.addr(), COMPLETIONS, &prefill_body(&ids, half)).await;
    assert_eq!(reply.status, 200);
    assert_eq!(proxy.drain(Duration::from_millis(300)).await, ["half"]);
    let held = d.stats().blocks_held;
    assert!(held > 0);
    (d, ids, reply.json(), held)
}

#[tokio::test]
async fn kv_on_one_of_two_ranks_is_refused() {
    let (d, ids, answer, held) = kv_on_rank_0_of_2().await;
    let first_tok = answer["kv_transfer_params"]["first_tok"].as_u64().unwrap();

    let reply = decode_after(&d, &ids, first_tok, 3).await;
    assert_eq!(reply.status, 500);
    let message = error_message(&reply);
    assert!(
        message.contains("KV cache for this request has not arrived"),
        "{message}"
    );
    assert!(message.contains("rank [1]"), "{message}");
    // Refused: rank 0's KV is still there, for its lease.
    assert_eq!(d.stats().blocks_held, held);
    assert_eq!(d.stats().kv_missing, 1);
}

/// LMCache's vLLM connector forwards its load errors (`get_block_ids_with_load_errors`),
/// so `kv_load_failure_policy="fail"` applies to a streamed decode whose KV is on one of
/// two ranks as to any failed load: a 200 head, then (chat) the role chunk, the error
/// event and `[DONE]`, or (completions) no chunk of the answer, only `[DONE]`.
#[tokio::test]
async fn streamed_decode_whose_kv_is_on_one_of_two_ranks_fails_in_the_stream() {
    let (d, ids, v, held) = kv_on_rank_0_of_2().await;
    let first_text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    let first_tok = v["kv_transfer_params"]["first_tok"].as_u64().unwrap();

    let mut prompt: Vec<u64> = ids.iter().map(|&i| u64::from(i)).collect();
    prompt.push(first_tok);
    let body = json!({"prompt": prompt, "max_tokens": 3, "stream": true});
    let reply = post(d.addr(), COMPLETIONS, &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.events(), [json!("[DONE]")], "{}", reply.text());

    // The chat whose template tokenizes to the same prompt.
    let content = format!("{PROMPT} {first_text}");
    let body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 3,
                      "stream": true});
    let reply = post(d.addr(), "/v1/chat/completions", &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let events = reply.events();
    assert_eq!(events.len(), 3, "{}", reply.text());
    assert_eq!(
        events[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let error = &events[1]["error"];
    assert_eq!(error["type"], "InternalServerError", "{}", events[1]);
    assert_eq!(error["code"], 500, "{}", events[1]);
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("KV cache for this request has not arrived")
            && message.contains("rank [1]"),
        "{message}"
    );
    assert_eq!(events[2], "[DONE]");

    // Refused, as unstreamed: rank 0's KV is still there, and it is counted as missing.
    let stats = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!(stats.blocks_held, held);
    assert_eq!(
        (
            stats.kv_missing,
            stats.kv_pull_failures,
            stats.remote_decodes,
            stats.local_prefills
        ),
        (2, 0, 0, 0)
    );
}

/// A prefill of `tp` tensor-parallel ranks.
async fn prefill_tp(proxy: &Proxy, tp: usize) -> SimEngine {
    SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Prefill),
        lmcache_proxy: Some(proxy.addr.clone()),
        lmcache_prefill_tp_size: Some(tp),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn prefill_with_fewer_tp_ranks_than_receiver_ports_never_completes() {
    let mut proxy = proxy().await;
    let p = prefill_tp(&proxy, 1).await;
    let d = decode(2).await;
    let ids = tokenize(PROMPT);
    // The spec names both decode ranks; the prefill's one rank pushes to
    // port 0 only and notifies once.
    let reply = post(p.addr(), COMPLETIONS, &prefill_body(&ids, spec("tp1", &d))).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let first_tok = reply.json()["kv_transfer_params"]["first_tok"]
        .as_u64()
        .unwrap();
    // A proxy waiting for one notification per receiver port waits in vain.
    assert_eq!(proxy.drain(Duration::from_millis(300)).await, ["tp1"]);
    let ps = p.stats();
    assert_eq!(
        (ps.kv_pushes, ps.notifications_sent, ps.kv_push_failures),
        (1, 1, 0)
    );
    // The decode has rank 0's KV only.
    let reply = decode_after(&d, &ids, first_tok, 3).await;
    assert_eq!(reply.status, 500);
    assert!(
        error_message(&reply).contains("rank [1]"),
        "{}",
        reply.text()
    );
}

#[tokio::test]
async fn prefill_with_more_tp_ranks_than_receiver_ports_fails() {
    let mut proxy = proxy().await;
    let p = prefill_tp(&proxy, 3).await;
    let d = decode(2).await;
    let ids = tokenize(PROMPT);
    let reply = post(p.addr(), COMPLETIONS, &prefill_body(&ids, spec("tp3", &d))).await;
    // Rank 2 indexes the port lists out of range, as LMCache does.
    assert_eq!(reply.status, 500, "{}", reply.text());
    let message = error_message(&reply);
    assert!(
        message.starts_with("KV transfer failed: rank 2")
            && message.contains("list index out of range"),
        "{message}"
    );
    // Ranks 0 and 1 pushed and notified before.
    assert_eq!(
        proxy.drain(Duration::from_millis(300)).await,
        ["tp3", "tp3"]
    );
    let ps = p.stats();
    assert_eq!(
        (ps.kv_pushes, ps.kv_push_failures, ps.notifications_sent),
        (2, 1, 2)
    );
    assert_eq!(d.stats().kv_received, 2);

    // With as many ranks as ports, the same request completes.
    let p2 = prefill_tp(&proxy, 2).await;
    let reply = post(p2.addr(), COMPLETIONS, &prefill_body(&ids, spec("tp2", &d))).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        proxy.drain(Duration::from_millis(300)).await,
        ["tp2", "tp2"]
    );
}

#[tokio::test]
async fn lost_and_duplicated_notifications() {
    let mut proxy = proxy().await;
    let p = prefill_with(
        Some(&proxy.addr),
        Faults {
            notify_loss: 1.0,
            ..Faults::default()
        },
    )
    .await;
    let d = decode(1).await;
    let ids = tokenize(PROMPT);
    let reply = post(p.addr(), COMPLETIONS, &prefill_body(&ids, spec("lost", &d))).await;
    assert_eq!(reply.status, 200);
    assert_eq!(proxy.next(Duration::from_millis(300)).await, None);
    assert_eq!(p.stats().notifications_lost, 1);
    assert_eq!(p.stats().notifications_sent, 0);
    // The KV did arrive.
    assert_eq!(d.stats().kv_received, 1);

    p.set_faults(Faults {
        notify_duplicates: 2,
        ..Faults::default()
    });
    let reply = post(p.addr(), COMPLETIONS, &prefill_body(&ids, spec("dup", &d))).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        proxy.drain(Duration::from_millis(300)).await,
        ["dup", "dup", "dup"]
    );
    assert_eq!(p.stats().notifications_sent, 3);
}

#[tokio::test]
async fn received_kv_expires() {
    let mut proxy = proxy().await;
    let p = prefill(&proxy).await;
    let d = decode_with(2, Duration::from_millis(150)).await;
    let ids = tokenize(PROMPT);
    let reply = post(p.addr(), COMPLETIONS, &prefill_body(&ids, spec("old", &d))).await;
    assert_eq!(reply.status, 200);
    let first_tok = reply.json()["kv_transfer_params"]["first_tok"]
        .as_u64()
        .unwrap();
    assert_eq!(proxy.drain(Duration::from_millis(100)).await.len(), 2);
    assert!(d.stats().blocks_held > 0);
    let stats = wait_for(&d, |s| s.blocks_held == 0).await;
    assert_eq!(stats.kv_expired, 2);

    // Expired on every rank: a miss, computed locally, not a remote decode.
    let reply = decode_after(&d, &ids, first_tok, 3).await;
    assert_eq!(reply.status, 200);
    let stats = d.stats();
    assert_eq!((stats.remote_decodes, stats.local_prefills), (0, 1));
}

#[tokio::test]
async fn prefill_without_spec_or_without_proxy() {
    let d = decode(1).await;
    let ids = tokenize(PROMPT);

    // No lmcache_proxy: a disagg_spec cannot be honoured.
    let p = prefill_with(None, Faults::default()).await;
    let reply = post(p.addr(), COMPLETIONS, &prefill_body(&ids, spec("x", &d))).await;
    assert_eq!(reply.status, 500);
    assert!(error_message(&reply).contains("lmcache_proxy"));
    assert_eq!(d.stats().kv_received, 0);

    // No disagg_spec: a plain engine.
    let reply = post(
        p.addr(),
        COMPLETIONS,
        &json!({"prompt": ids, "max_tokens": 4}),
    )
    .await;
    assert_eq!(reply.status, 200);
    let v = reply.json();
    assert_eq!(v["choices"][0]["text"], generate(PROMPT, 4, 0).concat());
    assert_eq!(v["kv_transfer_params"], Value::Null);
    assert_eq!(p.stats().prefill_requests, 0);

    // Batches are served as by a plain engine, but cannot be pushed.
    let reply = post(
        p.addr(),
        COMPLETIONS,
        &json!({"prompt": ["a b", "c"], "max_tokens": 2}),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.json()["choices"][1]["text"],
        generate("c", 2, 0).concat()
    );
    let mut batch = prefill_body(&ids, spec("b", &d));
    batch["prompt"] = json!([ids, ids]);
    assert_eq!(post(p.addr(), COMPLETIONS, &batch).await.status, 400);

    // A malformed disagg_spec is a 400.
    let bad = prefill_body(&ids, json!({"req_id": "r", "receiver_host": "127.0.0.1"}));
    assert_eq!(post(p.addr(), COMPLETIONS, &bad).await.status, 400);
}

#[tokio::test]
async fn a_missing_proxy_does_not_hang_the_prefill() {
    let (nobody, _held) = unused_port();
    let nobody = format!("127.0.0.1:{nobody}");
    let p = prefill_with(Some(&nobody), Faults::default()).await;
    let d = decode(2).await;
    let ids = tokenize(PROMPT);
    let started = Instant::now();
    let reply = post(p.addr(), COMPLETIONS, &prefill_body(&ids, spec("void", &d))).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let stats = p.stats();
    assert_eq!(stats.notifications_sent, 0);
    assert_eq!(stats.notification_failures, 2);
    assert_eq!(d.stats().kv_received, 2);
}

/// One request line to a receiver port, and its answer line.
async fn receiver_line(
    stream: &mut tokio::io::BufReader<tokio::net::TcpStream>,
    line: &Value,
) -> Value {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let mut out = serde_json::to_vec(line).unwrap();
    out.push(b'\n');
    stream.get_mut().write_all(&out).await.unwrap();
    let mut answer = String::new();
    stream.read_line(&mut answer).await.unwrap();
    assert!(
        answer.ends_with('\n'),
        "the receiver closed the connection: {answer:?}"
    );
    serde_json::from_str(&answer).unwrap()
}

/// The alloc port allocates the blocks a prompt of the model can have (at most
/// `max_model_len / block_size`, 512 by default), never the count a sender claims: 0,
/// one more, or a count no memory holds is refused with `{"ok": false}`, and the
/// receiver goes on serving.
#[tokio::test]
async fn receiver_allocates_only_the_blocks_a_prompt_can_have() {
    let d = decode(1).await;
    let (init, alloc) = (d.lmcache_init_ports()[0], d.lmcache_alloc_ports()[0]);
    let connect = |port: u16| async move {
        tokio::io::BufReader::new(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
        )
    };
    let mut init = connect(init).await;
    let mut ask = async |num_blocks: Value| {
        let session = receiver_line(
            &mut init,
            &json!({"type": "init", "rank": 0, "sender": "test"}),
        )
        .await;
        let mut alloc = connect(alloc).await;
        receiver_line(
            &mut alloc,
            &json!({"type": "alloc", "session": session["session"], "rank": 0,
                    "req_id": "r", "prompt_digest": "d", "num_blocks": num_blocks}),
        )
        .await
    };
    let granted = ask(json!(512)).await;
    assert_eq!(granted["ok"], true, "{granted}");
    assert_eq!(granted["block_ids"].as_array().unwrap().len(), 512);
    for num_blocks in [json!(0), json!(513), json!(u64::MAX)] {
        let refused = ask(num_blocks.clone()).await;
        assert_eq!(refused["ok"], false, "{num_blocks}: {refused}");
        assert!(refused.get("block_ids").is_none(), "{refused}");
        assert!(
            refused["error"].as_str().unwrap().contains("num_blocks"),
            "{refused}"
        );
    }
    let granted = ask(json!(1)).await;
    assert_eq!(granted["ok"], true, "{granted}");
    assert_eq!(d.stats().blocks_held, 0);
}

/// LMCache answers `first_tok` when the prefill's `kv_transfer_params` has the key
/// `ret_first_tok` at all (`"ret_first_tok" in params`), whatever its value; without
/// the key, the answer carries none.
#[tokio::test]
async fn ret_first_tok_is_read_for_presence_not_truth() {
    let mut proxy = proxy().await;
    let p = prefill(&proxy).await;
    let d = decode(1).await;
    let ids = tokenize(PROMPT);
    for (i, flag) in [json!(true), json!(false), Value::Null, json!(0)]
        .into_iter()
        .enumerate()
    {
        let req_id = format!("rft-{i}");
        let mut body = prefill_body(&ids, spec(&req_id, &d));
        body["kv_transfer_params"]["ret_first_tok"] = flag.clone();
        let reply = post(p.addr(), COMPLETIONS, &body).await;
        assert_eq!(reply.status, 200, "{flag}: {}", reply.text());
        let v = reply.json();
        assert!(v["kv_transfer_params"]["first_tok"].is_u64(), "{flag}: {v}");
        assert_eq!(
            proxy.next(Duration::from_secs(2)).await.as_deref(),
            Some(req_id.as_str())
        );
    }
    let mut body = prefill_body(&ids, spec("rft-absent", &d));
    body["kv_transfer_params"]
        .as_object_mut()
        .unwrap()
        .remove("ret_first_tok");
    let reply = post(p.addr(), COMPLETIONS, &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let v = reply.json();
    assert!(v["kv_transfer_params"].get("first_tok").is_none(), "{v}");
}
