//! End to end over real loopback sockets: the proxy in front of simulated vLLM-like
//! engines whose decode really pulls the KV from the prefill's side channel.

#[path = "../support/mod.rs"]
mod support;

use serde_json::{Value, json};
use support::*;

/// One request through the proxy; the same request straight to the decode engine must
/// give the same text, and the engines' counters must show a real KV handoff.
async fn disaggregated_equals_direct(path: &str, body: String) {
    let stack = Stack::start().await;
    let a = post(&stack.url, path, body.clone(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    let text = a.content();
    assert!(!text.is_empty());

    let (p, d) = (stack.p().stats(), stack.d().stats());
    assert_eq!(p.prefill_requests, 1, "prefill saw one prefill request");
    assert_eq!(p.kv_params_returned, 1);
    assert_eq!(p.side_channel_served, 1, "KV left over the side channel");
    assert_eq!(p.blocks_held, 0, "pulled blocks are freed");
    assert_eq!(d.remote_decodes, 1, "decode pulled the KV");
    assert_eq!(d.local_prefills, 0, "decode did not compute the prompt");
    assert_eq!(d.kv_pull_failures, 0);

    let direct = post(&stack.d().url(), path, body, &[]).await;
    assert_eq!(direct.status, 200);
    assert_eq!(direct.content(), text, "same text as a direct run");
    assert_eq!(stack.d().stats().local_prefills, 1);
}

#[tokio::test]
async fn chat_non_streaming() {
    disaggregated_equals_direct(
        "/v1/chat/completions",
        chat("the quick brown fox", 12, false),
    )
    .await;
}

#[tokio::test]
async fn chat_streaming() {
    disaggregated_equals_direct(
        "/v1/chat/completions",
        chat("the quick brown fox", 12, true),
    )
    .await;
}

#[tokio::test]
async fn completions_non_streaming() {
    disaggregated_equals_direct("/v1/completions", completion("once upon a time", 9, false)).await;
}

#[tokio::test]
async fn completions_streaming() {
    disaggregated_equals_direct("/v1/completions", completion("once upon a time", 9, true)).await;
}

#[tokio::test]
async fn streaming_answer_is_real_sse() {
    let stack = Stack::start().await;
    let a = post(
        &stack.url,
        "/v1/chat/completions",
        chat("stream me", 5, true),
        &[],
    )
    .await;
    assert!(
        a.header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = a.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    // Role chunk, five tokens; the decode's own framing reaches the client unchanged.
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks.len(), 6, "{events:?}");
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
}

#[tokio::test]
async fn prefill_sees_exactly_the_rewritten_body_and_decode_the_client_body() {
    let stack = Stack::start().await;
    let client_body = json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "rewrite me please"}],
        "max_tokens": 20,
        "max_completion_tokens": 20,
        "min_tokens": 2,
        "stream": true,
        "stream_options": {"include_usage": true},
        "stop": ["zzz"],
        "stop_token_ids": [7],
        "logprobs": true,
        "top_logprobs": 2,
        "temperature": 0.5,
        "custom_field": {"kept": [1, 2, 3]},
        "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "203.0.113.9", "remote_port": 1},
    });
    let a = post(
        &stack.url,
        "/v1/chat/completions",
        client_body.to_string(),
        &[],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.events().last().map(String::as_str), Some("[DONE]"));

    let p = stack.p().requests();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].path, "/v1/chat/completions");
    assert_eq!(
        p[0].body,
        json!({
            "model": "sim-model",
            "messages": [{"role": "user", "content": "rewrite me please"}],
            "max_tokens": 1,
            "max_completion_tokens": 1,
            "stream": false,
            "temperature": 0.5,
            "custom_field": {"kept": [1, 2, 3]},
            "ignore_eos": true,
            "kv_transfer_params": {
                "do_remote_decode": true, "do_remote_prefill": false,
                "remote_engine_id": null, "remote_block_ids": null,
                "remote_host": null, "remote_port": null,
            },
        })
    );

    let d = stack.d().requests();
    assert_eq!(d.len(), 1);
    let mut expect = client_body.clone();
    let params = &d[0].body["kv_transfer_params"];
    expect["kv_transfer_params"] = params.clone();
    assert_eq!(
        d[0].body, expect,
        "decode gets the client's body plus the handoff"
    );
    // The handoff is the prefill's, not the client's.
    assert_eq!(params["remote_engine_id"], stack.p().engine_id());
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], stack.p().side_channel_addr().port());
    assert_eq!(params["do_remote_prefill"], true);
    assert!(
        params["remote_block_ids"]
            .as_array()
            .is_some_and(|b| !b.is_empty())
    );
}

/// The `x-request-id` each engine received for the `i`th request it recorded.
fn engine_rid(engine: &disagg_sim::SimEngine, i: usize) -> String {
    engine.requests()[i]
        .headers
        .iter()
        .find(|(k, _)| k == "x-request-id")
        .map(|(_, v)| v.clone())
        .expect("the leg carried a request id")
}

/// The engines get the proxy's own id, the same on both legs of a request and new for
/// every request, whatever the client sends (vLLM's push-mode NIXL pairs the legs by it,
/// and a client's id can repeat); the client's id stays in the answer.
#[tokio::test]
async fn client_request_id_stays_in_the_answer_and_engines_get_a_fresh_shared_one() {
    let stack = Stack::start().await;
    for _ in 0..2 {
        let a = post(
            &stack.url,
            "/v1/completions",
            completion("ids", 3, false),
            &[("x-request-id", "client-rid-42")],
        )
        .await;
        assert_eq!(a.status, 200);
        assert_eq!(a.header("x-request-id"), Some("client-rid-42"));
    }
    let (p0, d0) = (engine_rid(stack.p(), 0), engine_rid(stack.d(), 0));
    let (p1, d1) = (engine_rid(stack.p(), 1), engine_rid(stack.d(), 1));
    assert_eq!(p0, d0, "both legs of a request carry one id");
    assert_eq!(p1, d1, "both legs of a request carry one id");
    assert_ne!(
        p0, p1,
        "a repeated client id must not repeat on the engines"
    );
    for rid in [&p0, &p1] {
        assert_ne!(rid, "client-rid-42");
        assert_eq!(rid.len(), 32);
    }
}

#[tokio::test]
async fn generated_request_id_answers_and_legs_share_one_id() {
    let stack = Stack::start().await;
    let a = post(
        &stack.url,
        "/v1/completions",
        completion("ids", 3, false),
        &[],
    )
    .await;
    let rid = a.header("x-request-id").expect("a request id").to_owned();
    assert_eq!(rid.len(), 32);
    assert_eq!(engine_rid(stack.p(), 0), engine_rid(stack.d(), 0));
}

#[tokio::test]
async fn session_header_is_kept_on_both_legs_whatever_its_spelling() {
    let stack = Stack::start().await;
    for (name, value) in [("x-session-id", "s-1"), ("x_session_id", "s-2")] {
        let a = post(
            &stack.url,
            "/v1/completions",
            completion("s", 2, false),
            &[(name, value)],
        )
        .await;
        assert_eq!(a.status, 200);
    }
    for engine in [stack.p(), stack.d()] {
        let reqs = engine.requests();
        assert!(
            reqs[0]
                .headers
                .iter()
                .any(|(k, v)| k == "x-session-id" && v == "s-1")
        );
        assert!(
            reqs[1]
                .headers
                .iter()
                .any(|(k, v)| k == "x_session_id" && v == "s-2")
        );
    }
}

#[tokio::test]
async fn authorization_is_not_forwarded_unless_configured() {
    let stack = Stack::start().await;
    post(
        &stack.url,
        "/v1/completions",
        completion("a", 2, false),
        &[("authorization", "Bearer k")],
    )
    .await;
    assert!(
        !stack.p().requests()[0]
            .headers
            .iter()
            .any(|(k, _)| k == "authorization")
    );

    let stack = Stack::builder()
        .config(|c| c.forward_authorization = true)
        .build()
        .await;
    post(
        &stack.url,
        "/v1/completions",
        completion("a", 2, false),
        &[("authorization", "Bearer k")],
    )
    .await;
    for engine in [stack.p(), stack.d()] {
        assert!(
            engine.requests()[0]
                .headers
                .iter()
                .any(|(k, v)| k == "authorization" && v == "Bearer k")
        );
    }
}

#[tokio::test]
async fn eos_first_token_still_hands_over_kv() {
    // With an EOS at every position the prefill would end "stopped" and vLLM would keep
    // no KV; the rewriter's ignore_eos keeps it length-capped.
    let eos = disagg_sim::SimConfig {
        eos_period: 1,
        ..Default::default()
    };
    let stack = Stack::builder().prefill(vec![eos]).build().await;
    let a = post(
        &stack.url,
        "/v1/completions",
        completion("stop early", 4, false),
        &[],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    assert_eq!(stack.d().stats().remote_decodes, 1);
}

#[tokio::test]
async fn xpyd_round_robin_spreads_both_legs() {
    use disagg_sim::SimConfig;
    let stack = Stack::builder()
        .prefill(vec![SimConfig::default(), SimConfig::default()])
        .decode(vec![
            SimConfig::default(),
            SimConfig::default(),
            SimConfig::default(),
        ])
        .build()
        .await;
    for i in 0..6 {
        let a = post(
            &stack.url,
            "/v1/completions",
            completion(&format!("req {i}"), 2, false),
            &[],
        )
        .await;
        assert_eq!(a.status, 200);
    }
    for p in &stack.prefill {
        assert_eq!(p.stats().prefill_requests, 3);
        assert_eq!(p.stats().side_channel_served, 3);
    }
    for d in &stack.decode {
        assert_eq!(d.stats().remote_decodes, 2);
    }
}

#[tokio::test]
async fn health_models_and_unknown_routes() {
    let stack = Stack::start().await;
    let h = get(&stack.url, "/health").await;
    assert_eq!(h.status, 200);
    let m = get(&stack.url, "/v1/models").await;
    assert_eq!(m.status, 200);
    let v = m.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "sim-model");
    // A route the proxy does not know goes to an engine: its answer is the engine's.
    let unknown = get(&stack.url, "/v2/nothing").await;
    let own = get(&stack.d().url(), "/v2/nothing").await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.json(), own.json());
    assert_openai_error(
        &get(&stack.url, "/v1/completions").await,
        405,
        "method_not_allowed",
    );
}

#[tokio::test]
async fn server_timing_reports_phases() {
    let stack = Stack::start().await;
    let a = post(
        &stack.url,
        "/v1/completions",
        completion("time", 2, false),
        &[],
    )
    .await;
    let t = a.header("server-timing").expect("server-timing");
    for phase in ["prefill;dur=", "handoff;dur=", "decode;dur="] {
        assert!(t.contains(phase), "{t}");
    }
}

/// Read a raw HTTP/1.1 response with a chunked body; return each chunk with the time it
/// was complete, measured from the request.
async fn raw_chunks(base: &str, path: &str, body: &str) -> Vec<(std::time::Duration, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let start = std::time::Instant::now();
    let mut s = raw_request(base, path, body).await;
    let mut buf = Vec::new();
    let mut chunks = Vec::new();
    let mut head_done = None;
    let mut tmp = [0u8; 65536];
    loop {
        let n = s.read(&mut tmp).await.unwrap();
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&tmp[..n]);
        if head_done.is_none() {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                head_done = Some(());
                buf.drain(..i + 4);
            } else {
                continue;
            }
        }
        // Take every complete chunk.
        while let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
            let size = usize::from_str_radix(std::str::from_utf8(&buf[..i]).unwrap(), 16).unwrap();
            if buf.len() < i + 2 + size + 2 {
                break;
            }
            let data = buf[i + 2..i + 2 + size].to_vec();
            buf.drain(..i + 2 + size + 2);
            if size == 0 {
                return chunks;
            }
            chunks.push((start.elapsed(), data));
        }
    }
    chunks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_events_reach_the_client_as_they_arrive() {
    // 10 tokens, 40 ms apart: each must be forwarded when it comes, not at the end.
    let slow = disagg_sim::SimConfig {
        inter_token_delay: std::time::Duration::from_millis(40),
        ..Default::default()
    };
    let stack = Stack::builder().decode(vec![slow]).build().await;
    let chunks = raw_chunks(&stack.url, "/v1/chat/completions", &chat("pace", 10, true)).await;
    let events: usize = chunks
        .iter()
        .map(|(_, c)| String::from_utf8_lossy(c).matches("data: ").count())
        .sum();
    assert_eq!(events, 12, "role chunk, 10 tokens, [DONE]");
    assert!(
        chunks.len() >= 9,
        "tokens spaced in time go out one by one: {}",
        chunks.len()
    );
    let first = chunks[0].0;
    let last = chunks[chunks.len() - 1].0;
    assert!(
        last - first >= std::time::Duration::from_millis(300),
        "the first token left {first:?}, the last {last:?}: the stream was buffered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_that_arrive_together_leave_together() {
    // A zero-delay decode writes its 18 events in one burst; the proxy joins the frames
    // that have already arrived instead of writing each on its own.
    let stack = Stack::start().await;
    let chunks = raw_chunks(&stack.url, "/v1/chat/completions", &chat("burst", 16, true)).await;
    let events: usize = chunks
        .iter()
        .map(|(_, c)| String::from_utf8_lossy(c).matches("data: ").count())
        .sum();
    assert_eq!(events, 18);
    assert!(
        chunks.len() < events,
        "{} chunks for {events} events",
        chunks.len()
    );
}

#[tokio::test]
async fn decode_reuses_its_side_channel_connection() {
    // vLLM makes the NIXL handshake once per remote engine; the simulated decode keeps
    // its side-channel connection to the prefill for later pulls in the same way.
    let stack = Stack::start().await;
    for i in 0..5 {
        let a = post(
            &stack.url,
            "/v1/completions",
            completion(&format!("reuse {i}"), 2, false),
            &[],
        )
        .await;
        assert_eq!(a.status, 200);
    }
    let p = stack.p().stats();
    assert_eq!(p.side_channel_served, 5);
    assert_eq!(p.side_channel_connections, 1);
    assert_eq!(stack.d().stats().remote_decodes, 5);
}

#[tokio::test]
async fn upstream_connections_are_kept_alive_and_reused() {
    let stack = Stack::start().await;
    for i in 0..4 {
        let a = post(
            &stack.url,
            "/v1/completions",
            completion(&format!("ka {i}"), 2, false),
            &[],
        )
        .await;
        assert_eq!(a.status, 200);
        let a = post(
            &stack.url,
            "/v1/chat/completions",
            chat(&format!("ka {i}"), 3, true),
            &[],
        )
        .await;
        assert_eq!(a.status, 200);
    }
    // Eight sequential requests, each leg on the one pooled connection per engine.
    for engine in [stack.p(), stack.d()] {
        let s = engine.stats();
        assert_eq!(s.requests, 8);
        assert!(
            eventually(std::time::Duration::from_secs(1), || engine
                .stats()
                .open_connections
                == 1)
            .await,
            "{s:?}"
        );
    }
}

/// Two side-channel bases free on this machine now: tests never use fixed ports, so the
/// plan's bases are taken from the OS and handed to the planner as explicit bases. The
/// listeners hold them, and become the engines' side channels.
fn free_ports() -> (std::net::TcpListener, std::net::TcpListener) {
    let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    (a, b)
}

#[tokio::test]
async fn side_channel_ports_come_from_the_nixl_planner() {
    use disagg_nixl::{Deployment, Host, NixlRole, Plan, PortScheme};
    let (hold_p, hold_d) = free_ports();
    let (base_p, base_d) = (
        hold_p.local_addr().unwrap().port(),
        hold_d.local_addr().unwrap().port(),
    );
    let plan = Plan::new(PortScheme::PerEngine)
        .with_host(
            Host::new("127.0.0.1")
                .with_deployment(Deployment::new("prefill", NixlRole::Prefill).with_base(base_p))
                .with_deployment(Deployment::new("decode", NixlRole::Decode).with_base(base_d)),
        )
        .plan()
        .expect("a plan with disjoint bases");
    let [p_plan, d_plan] = [&plan.engines[0], &plan.engines[1]];
    assert_eq!((p_plan.port, d_plan.port), (base_p, base_d));

    // The side channels listen on the planned ports through the sockets that held them
    // since they were drawn: never released, so nothing else can take them meanwhile.
    let mut engines = Vec::new();
    for (e, hold) in [(p_plan, hold_p), (d_plan, hold_d)] {
        hold.set_nonblocking(true).unwrap();
        let side = tokio::net::TcpListener::from_std(hold).unwrap();
        assert_eq!(side.local_addr().unwrap().port(), e.port);
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let config = disagg_sim::SimConfig {
            engine_id: Some(e.engine_id.clone()),
            ..Default::default()
        };
        engines.push(
            disagg_sim::SimEngine::start_on(config, http, side)
                .await
                .unwrap(),
        );
    }
    let decode = engines.pop().unwrap();
    let prefill = engines.pop().unwrap();
    let stack = Stack::builder()
        .build_with(vec![prefill], vec![decode])
        .await;

    let a = post(
        &stack.url,
        "/v1/completions",
        completion("planned", 3, false),
        &[],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    // The decode pulled from the planned port, identified by the planned engine id.
    let params = &stack.d().requests()[0].body["kv_transfer_params"];
    assert_eq!(params["remote_port"], base_p);
    assert_eq!(params["remote_engine_id"], p_plan.engine_id.as_str());
    assert_eq!(stack.d().stats().remote_decodes, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_of_two_decode_avoids_the_engine_holding_a_stream() {
    use disagg_affinity::{PerLeg, PowerOfTwo, RoundRobin};
    // In flight is counted until the response body ends: while one decode engine holds
    // a long stream, power-of-two choices sends every other request to the other one.
    let slow = disagg_sim::SimConfig {
        inter_token_delay: std::time::Duration::from_millis(100),
        ..Default::default()
    };
    let stack = Stack::builder()
        .decode(vec![slow.clone(), slow])
        .router(PerLeg::new(RoundRobin::new(), PowerOfTwo::from_seed(11)))
        .build()
        .await;
    let url = stack.url.clone();
    let long = tokio::spawn(async move {
        post(&url, "/v1/chat/completions", chat("long", 20, true), &[]).await
    });
    assert!(eventually(std::time::Duration::from_secs(2), || stack.in_flight() == 1).await);
    // The engine counts the request once its body is in, a moment after the proxy
    // counts the leg.
    assert!(
        eventually(std::time::Duration::from_secs(2), || {
            stack.decode.iter().any(|d| d.stats().active_requests == 1)
        })
        .await
    );
    let busy = if stack.decode[0].stats().active_requests == 1 {
        0
    } else {
        1
    };
    for i in 0..5 {
        let a = post(
            &stack.url,
            "/v1/completions",
            completion(&format!("short {i}"), 1, false),
            &[],
        )
        .await;
        assert_eq!(a.status, 200);
    }
    assert_eq!(
        stack.decode[busy].stats().requests,
        1,
        "only the long stream"
    );
    assert_eq!(stack.decode[1 - busy].stats().requests, 5);
    assert_eq!(long.await.unwrap().status, 200);
}

#[tokio::test]
async fn consistent_hash_keeps_a_session_on_its_engines() {
    use disagg_affinity::{ConsistentHash, PerLeg};
    use disagg_sim::SimConfig;
    let three = || {
        vec![
            SimConfig::default(),
            SimConfig::default(),
            SimConfig::default(),
        ]
    };
    let stack = Stack::builder()
        .prefill(three())
        .decode(three())
        .router(PerLeg::new(
            ConsistentHash::default(),
            ConsistentHash::default(),
        ))
        .build()
        .await;
    for (session, spelling) in [("alice", "x-session-id"), ("bob", "x_session_id")] {
        for i in 0..10 {
            let a = post(
                &stack.url,
                "/v1/completions",
                completion(&format!("{session} turn {i}"), 2, false),
                &[(spelling, session)],
            )
            .await;
            assert_eq!(a.status, 200);
        }
    }
    // Each session's ten requests all went to one prefill and one decode engine.
    for engines in [&stack.prefill, &stack.decode] {
        for session in ["alice", "bob"] {
            let hits: Vec<usize> = engines
                .iter()
                .map(|e| {
                    e.requests()
                        .iter()
                        .filter(|r| r.headers.iter().any(|(_, v)| v == session))
                        .count()
                })
                .collect();
            assert_eq!(
                hits.iter().filter(|&&n| n > 0).count(),
                1,
                "{session}: {hits:?}"
            );
            assert_eq!(hits.iter().sum::<usize>(), 10);
        }
    }
}
