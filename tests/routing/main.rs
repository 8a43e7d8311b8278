//! Routing end to end, over real loopback sockets: three prefill and three decode
//! simulated engines (3P3D) behind the proxy, with each policy, session affinity, model
//! routing, conditional disaggregation and data-parallel ranks.

#[path = "../support/mod.rs"]
mod support;

use std::time::Duration;

use disagg_affinity::{
    ConsistentHash, LeastInFlight, PerLeg, PowerOfTwo, PromptThreshold, Random, RoundRobin,
    WeightedRandom,
};
use disagg_core::Role;
use disagg_core::router::Pick;
use disagg_sim::{SimConfig, SimEngine};
use support::*;

fn three() -> Vec<SimConfig> {
    vec![SimConfig::default(); 3]
}

/// A 3P3D stack with `prefill` and `decode` as the per-leg policies.
async fn stack_3p3d(prefill: impl Pick, decode: impl Pick) -> Stack {
    Stack::builder()
        .prefill(three())
        .decode(three())
        .router(PerLeg::new(prefill, decode))
        .build()
        .await
}

/// `n` distinct completions, all succeeding with a real KV handoff.
async fn send(stack: &Stack, n: usize, headers: &[(&str, &str)]) {
    for i in 0..n {
        let a = post(
            &stack.url,
            "/v1/completions",
            completion(&format!("request {i}"), 2, false),
            headers,
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    }
}

/// Requests each engine served, in order.
fn served(engines: &[SimEngine]) -> Vec<u64> {
    engines.iter().map(|e| e.stats().requests).collect()
}

#[tokio::test]
async fn round_robin_gives_each_engine_its_turn() {
    let stack = stack_3p3d(RoundRobin::new(), RoundRobin::new()).await;
    send(&stack, 30, &[]).await;
    assert_eq!(served(&stack.prefill), [10, 10, 10]);
    assert_eq!(served(&stack.decode), [10, 10, 10]);
}

#[tokio::test]
async fn random_reaches_every_engine() {
    let stack = stack_3p3d(Random::from_seed(3), Random::from_seed(4)).await;
    send(&stack, 60, &[]).await;
    for counts in [served(&stack.prefill), served(&stack.decode)] {
        assert_eq!(counts.iter().sum::<u64>(), 60);
        // Uniform: 20 each expected; 8 would be a 3-sigma miss.
        assert!(counts.iter().all(|&n| n >= 8), "{counts:?}");
    }
}

#[tokio::test]
async fn weighted_random_follows_the_weights_end_to_end() {
    // The weights name the engines' URLs, known once they run: start the engines
    // first, then the proxy over them.
    let mut engines = Vec::new();
    for _ in 0..6 {
        engines.push(SimEngine::start(SimConfig::default()).await.unwrap());
    }
    let decode = engines.split_off(3);
    let heavy = decode[2].url();
    let stack = Stack::builder()
        .router(PerLeg::new(
            RoundRobin::new(),
            WeightedRandom::from_seed(7).with_weight(&heavy, 8.0),
        ))
        .build_with(engines, decode)
        .await;
    send(&stack, 100, &[]).await;
    let counts = served(&stack.decode);
    // Expected shares 10%, 10%, 80%.
    assert!(counts[2] >= 65, "{counts:?}");
    assert!(counts[0] > 0 && counts[1] > 0, "{counts:?}");
}

#[tokio::test]
async fn least_in_flight_spreads_an_idle_set_evenly() {
    let stack = stack_3p3d(LeastInFlight::new(), LeastInFlight::new()).await;
    send(&stack, 30, &[]).await;
    // One request at a time: every choice is a tie, broken in turn.
    assert_eq!(served(&stack.prefill), [10, 10, 10]);
    assert_eq!(served(&stack.decode), [10, 10, 10]);
}

#[tokio::test]
async fn power_of_two_spreads_an_idle_set() {
    let stack = stack_3p3d(PowerOfTwo::from_seed(5), PowerOfTwo::from_seed(6)).await;
    send(&stack, 60, &[]).await;
    for counts in [served(&stack.prefill), served(&stack.decode)] {
        assert!(counts.iter().all(|&n| n >= 8), "{counts:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_in_flight_counts_a_streaming_decode_until_its_last_chunk() {
    let slow = SimConfig {
        inter_token_delay: Duration::from_millis(40),
        ..SimConfig::default()
    };
    let stack = Stack::builder()
        .prefill(three())
        .decode(vec![slow; 3])
        .router(PerLeg::new(RoundRobin::new(), LeastInFlight::new()))
        .build()
        .await;
    // A 30-token stream (~1.2 s) holds one decode engine; its head arrived long before.
    let url = stack.url.clone();
    let long = tokio::spawn(async move {
        post(&url, "/v1/chat/completions", chat("long", 30, true), &[]).await
    });
    assert!(eventually(Duration::from_secs(2), || stack.in_flight() == 1).await);
    // The engine counts the request once its body is in, a moment after the proxy
    // counts the leg.
    let streaming = |i: usize| stack.decode[i].stats().active_requests == 1;
    assert!(eventually(Duration::from_secs(2), || (0..3).any(streaming)).await);
    let busy = (0..3).find(|&i| streaming(i)).expect("one engine streams");
    // While it streams, nine short requests avoid it and still spread over the others.
    for i in 0..9 {
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
        stack.decode[busy].stats().active_requests,
        1,
        "still streaming"
    );
    assert_eq!(stack.decode[busy].stats().requests, 1, "only the stream");
    let long = long.await.unwrap();
    assert_eq!(long.status, 200);
    assert_eq!(long.events().last().map(String::as_str), Some("[DONE]"));
    // Once the stream ended, its engine is counted idle again and gets its turn.
    assert!(eventually(Duration::from_secs(1), || stack.in_flight() == 0).await);
    send(&stack, 3, &[]).await;
    assert!(stack.decode[busy].stats().requests >= 2);
}

/// Which engine served each of `sessions`' requests, by the session header they carried.
fn engines_of(engines: &[SimEngine], session: &str) -> Vec<usize> {
    engines
        .iter()
        .enumerate()
        .filter(|(_, e)| {
            e.requests()
                .iter()
                .any(|r| r.header("x-session-id") == Some(session))
        })
        .map(|(i, _)| i)
        .collect()
}

#[tokio::test]
async fn a_session_keeps_its_engines_across_fifty_requests() {
    let stack = stack_3p3d(ConsistentHash::default(), ConsistentHash::default()).await;
    send(&stack, 50, &[("x-session-id", "long-chat")]).await;
    for engines in [&stack.prefill, &stack.decode] {
        let used = engines_of(engines, "long-chat");
        assert_eq!(used.len(), 1, "{used:?}");
        assert_eq!(engines[used[0]].stats().requests, 50);
    }
}

#[tokio::test]
async fn removing_the_pinned_engine_moves_only_its_sessions() {
    let stack = stack_3p3d(ConsistentHash::default(), ConsistentHash::default()).await;
    let sessions: Vec<String> = (0..12).map(|i| format!("session-{i}")).collect();
    let decode_of = |stack: &Stack, s: &str| {
        let set = engines_of(&stack.decode, s);
        assert_eq!(set.len(), 1, "{s}: {set:?}");
        set[0]
    };
    for s in &sessions {
        send(&stack, 2, &[("x-session-id", s)]).await;
    }
    let before: Vec<usize> = sessions.iter().map(|s| decode_of(&stack, s)).collect();
    // Remove the engine the first session is pinned to.
    let gone = before[0];
    assert!(stack.source.remove(&stack.decode[gone].url()));
    for d in &stack.decode {
        d.clear_requests();
    }
    for s in &sessions {
        send(&stack, 2, &[("x-session-id", s)]).await;
    }
    let mut moved = 0;
    for (s, was) in sessions.iter().zip(&before) {
        let now = decode_of(&stack, s);
        if *was == gone {
            assert_ne!(now, gone, "{s} left the removed engine");
            moved += 1;
        } else {
            assert_eq!(now, *was, "{s} was not on the removed engine and stays");
        }
    }
    assert!(moved >= 1);
    assert!(
        moved < sessions.len(),
        "only the removed engine's sessions move"
    );
    assert_eq!(
        stack.decode[gone].stats().requests,
        2 * before.iter().filter(|&&e| e == gone).count() as u64
    );
}

#[tokio::test]
async fn requests_go_to_the_engines_serving_their_model() {
    let model = |m: &str| SimConfig {
        model: m.to_owned(),
        ..SimConfig::default()
    };
    let stack = Stack::builder()
        .prefill(vec![model("llama"), model("llama"), model("qwen")])
        .decode(vec![model("llama"), model("qwen"), model("qwen")])
        .declare_models()
        .build()
        .await;
    for (m, n) in [("llama", 4), ("qwen", 6)] {
        for i in 0..n {
            let body =
                serde_json::json!({"model": m, "prompt": format!("{m} {i}"), "max_tokens": 2});
            let a = post(&stack.url, "/v1/completions", body.to_string(), &[]).await;
            // The simulated engines refuse a model they do not serve (404, as vLLM):
            // a wrong route would fail here.
            assert_eq!(a.status, 200, "{}", a.text());
            assert_eq!(a.json()["model"], m);
        }
    }
    assert_eq!(served(&stack.prefill), [2, 2, 6]);
    assert_eq!(served(&stack.decode), [4, 3, 3]);

    let body = serde_json::json!({"model": "gpt-5", "prompt": "x", "max_tokens": 2});
    let a = post(&stack.url, "/v1/completions", body.to_string(), &[]).await;
    assert_openai_error(&a, 404, "model_not_found");
    let msg = a.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        msg.contains("gpt-5") && msg.contains("llama, qwen"),
        "{msg}"
    );

    let no_model = serde_json::json!({"prompt": "x", "max_tokens": 2});
    let a = post(&stack.url, "/v1/completions", no_model.to_string(), &[]).await;
    assert_openai_error(&a, 400, "model_required");

    let listed = get(&stack.url, "/v1/models").await;
    assert_eq!(listed.status, 200);
    let ids: Vec<String> = listed.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(ids, ["llama", "qwen"]);
    // None of the refused requests reached an engine.
    assert_eq!(served(&stack.prefill).iter().sum::<u64>(), 10);
}

#[tokio::test]
async fn short_prompts_skip_the_prefill_leg() {
    let stack = Stack::builder()
        .prefill(three())
        .decode(three())
        .disaggregate(PromptThreshold::new(64))
        .build()
        .await;
    let short = post(
        &stack.url,
        "/v1/completions",
        completion("hi", 3, false),
        &[],
    )
    .await;
    assert_eq!(short.status, 200, "{}", short.text());
    assert_eq!(short.header("x-disagg-handoff"), Some("direct"));
    assert_eq!(served(&stack.prefill), [0, 0, 0]);
    // The decode engine computed the prompt itself: no KV was pulled.
    assert_eq!(
        stack
            .decode
            .iter()
            .map(|d| d.stats().remote_decodes)
            .sum::<u64>(),
        0
    );
    let streamed = post(
        &stack.url,
        "/v1/chat/completions",
        chat("hello", 3, true),
        &[],
    )
    .await;
    assert_eq!(streamed.header("x-disagg-handoff"), Some("direct"));
    assert_eq!(streamed.events().last().map(String::as_str), Some("[DONE]"));

    let long_prompt = "a long document ".repeat(40);
    let long = post(
        &stack.url,
        "/v1/completions",
        completion(&long_prompt, 3, false),
        &[],
    )
    .await;
    assert_eq!(long.status, 200, "{}", long.text());
    assert_eq!(long.header("x-disagg-handoff"), Some("kv"));
    assert_eq!(served(&stack.prefill).iter().sum::<u64>(), 1);
    assert_eq!(
        stack
            .decode
            .iter()
            .map(|d| d.stats().remote_decodes)
            .sum::<u64>(),
        1
    );
}

#[tokio::test]
async fn data_parallel_ranks_are_routed_and_named_to_the_engine() {
    // Mooncake: the prefill's answer is keyed by the engine id of the rank that served
    // it, so a rank the connector did not name to the engine fails the KV pull.
    let ranked = SimConfig {
        dp_size: 2,
        ..SimConfig::default()
    };
    let stack = Stack::builder()
        .protocol(Protocol::Mooncake)
        .prefill(vec![ranked.clone()])
        .decode(vec![ranked])
        .ranks(2, 2)
        .build()
        .await;
    send_any(&stack, 8).await;
    for engine in [stack.p(), stack.d()] {
        let ranks: Vec<Option<String>> = engine
            .requests()
            .iter()
            .map(|r| r.header("x-data-parallel-rank").map(str::to_owned))
            .collect();
        assert_eq!(ranks.len(), 8);
        for rank in ["0", "1"] {
            let n = ranks.iter().filter(|r| r.as_deref() == Some(rank)).count();
            assert_eq!(n, 4, "rank {rank} gets its turn: {ranks:?}");
        }
    }
    let set = disagg_core::EndpointSource::snapshot(&*stack.source);
    assert_eq!(set.by_role(Role::Prefill).len(), 2, "one endpoint per rank");
}

/// `n` completions that must succeed, whatever handoff mark they carry.
async fn send_any(stack: &Stack, n: usize) {
    for i in 0..n {
        let a = post(
            &stack.url,
            "/v1/completions",
            completion(&format!("ranked {i}"), 2, false),
            &[],
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
}

/// A chat body with `system` as the system prompt and `user` as the turn.
fn chat_with(system: &str, user: &str) -> String {
    serde_json::json!({
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "max_tokens": 2,
    })
    .to_string()
}

#[tokio::test]
async fn cache_aware_keeps_a_shared_prefix_on_one_prefill_engine() {
    use disagg_affinity::CacheAware;
    let stack = stack_3p3d(CacheAware::default(), RoundRobin::new()).await;
    // Three tenants, each with its own long system prompt and many different questions.
    let systems: Vec<String> = (0..3)
        .map(|t| format!("tenant {t}: ") + &"You are a careful assistant. ".repeat(40))
        .collect();
    // In an irregular order, so that no rotation could pin them by accident.
    let order = [0, 0, 1, 2, 1, 0, 2, 2, 1, 0, 1, 2, 0, 2, 1, 1, 0, 2, 0, 1];
    for (q, &t) in order.iter().enumerate() {
        let a = post(
            &stack.url,
            "/v1/chat/completions",
            chat_with(&systems[t], &format!("question {q}")),
            &[],
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    }
    // Each tenant's prompts all went to one prefill engine, and the tenants spread.
    let mut homes = Vec::new();
    for t in 0..systems.len() {
        let tag = format!("tenant {t}: ");
        let used: Vec<usize> = stack
            .prefill
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                e.requests().iter().any(|r| {
                    r.body["messages"][0]["content"]
                        .as_str()
                        .is_some_and(|c| c.starts_with(&tag))
                })
            })
            .map(|(i, _)| i)
            .collect();
        assert_eq!(used.len(), 1, "tenant {t}: {used:?}");
        homes.push(used[0]);
    }
    homes.sort_unstable();
    homes.dedup();
    assert!(
        homes.len() >= 2,
        "the tenants do not all share one engine: {homes:?}"
    );
}
