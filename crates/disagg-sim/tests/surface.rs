//! The engine's routes beyond chat and completions: model cards, tokenizer routes,
//! version, embeddings, the Responses API, LoRA admin routes, and SGLang's native
//! `/generate` on both roles with the bootstrap handoff.

mod common;

use std::time::Duration;

use common::*;
use disagg_sim::{Faults, KvMode, SimConfig, SimEngine, SimRole, tokenize};
use serde_json::{Value, json};

async fn engine(tweak: impl FnOnce(&mut SimConfig)) -> SimEngine {
    let mut config = SimConfig::default();
    tweak(&mut config);
    SimEngine::start(config).await.unwrap()
}

#[tokio::test]
async fn models_carry_every_vllm_field_and_loaded_adapters() {
    let e = engine(|_| {}).await;
    let models = get(e.addr(), "/v1/models").await.json();
    let card = &models["data"][0];
    for key in [
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    ] {
        assert!(card.get(key).is_some(), "{key} missing: {card}");
    }
    assert_eq!(card["root"], "sim-model");
    assert_eq!(card["permission"][0]["object"], "model_permission");

    let load = post(
        e.addr(),
        "/v1/load_lora_adapter",
        &json!({"lora_name": "sql", "lora_path": "/adapters/sql"}),
    )
    .await;
    assert_eq!(load.status, 200, "{}", load.text());
    assert_eq!(
        load.text(),
        "Success: LoRA adapter 'sql' added successfully."
    );
    assert_eq!(e.lora_adapters(), ["sql"]);
    let models = get(e.addr(), "/v1/models").await.json();
    let lora = &models["data"][1];
    assert_eq!(
        (&lora["id"], &lora["root"], &lora["parent"]),
        (&json!("sql"), &json!("/adapters/sql"), &json!("sim-model"))
    );
    // Loaded twice without `load_inplace`: vLLM's 400.
    let again = post(
        e.addr(),
        "/v1/load_lora_adapter",
        &json!({"lora_name": "sql", "lora_path": "/adapters/sql"}),
    )
    .await;
    assert_eq!(again.status, 400);
    let unload = post(
        e.addr(),
        "/v1/unload_lora_adapter",
        &json!({"lora_name": "sql"}),
    )
    .await;
    assert_eq!(unload.status, 200);
    assert!(e.lora_adapters().is_empty());
    assert_eq!(e.stats().admin_requests, 3);

    // An engine told to fail its admin routes changes nothing.
    e.set_faults(Faults {
        admin_status: Some(500),
        ..Faults::default()
    });
    let failed = post(
        e.addr(),
        "/v1/load_lora_adapter",
        &json!({"lora_name": "x", "lora_path": "/x"}),
    )
    .await;
    assert_eq!(failed.status, 500);
    assert!(e.lora_adapters().is_empty());
}

#[tokio::test]
async fn tokenize_and_detokenize_round_trip_and_version_answers() {
    let e = engine(|_| {}).await;
    let t = post(
        e.addr(),
        "/tokenize",
        &json!({"prompt": "hello disaggregated world"}),
    )
    .await;
    let ids = t.json()["tokens"].clone();
    assert_eq!(ids, json!(tokenize("hello disaggregated world")));
    let d = post(e.addr(), "/detokenize", &json!({"tokens": ids})).await;
    assert_eq!(d.json(), json!({"prompt": "hello disaggregated world"}));
    let bad = post(e.addr(), "/detokenize", &json!({"tokens": [u32::MAX]})).await;
    assert_eq!(bad.status, 400);
    assert_eq!(
        get(e.addr(), "/version").await.json(),
        json!({"version": "0.33.0"})
    );
    assert_eq!(e.stats().detokenize_requests, 2);
    let older = engine(|c| c.version = "0.32.1".into()).await;
    assert_eq!(
        get(older.addr(), "/version").await.json(),
        json!({"version": "0.32.1"})
    );
}

#[tokio::test]
async fn embeddings_are_deterministic_per_input() {
    let e = engine(|_| {}).await;
    let body = json!({"model": "sim-model", "input": ["one two", "three"]});
    let a = post(e.addr(), "/v1/embeddings", &body).await.json();
    let b = post(e.addr(), "/v1/embeddings", &body).await.json();
    assert_eq!(a["object"], "list");
    assert_eq!(a["data"][0]["object"], "embedding");
    assert_eq!(a["data"], b["data"]);
    assert_ne!(a["data"][0]["embedding"], a["data"][1]["embedding"]);
    assert_eq!(a["usage"]["prompt_tokens"], 3);
    let base64 = post(
        e.addr(),
        "/v1/embeddings",
        &json!({"input": "one two", "encoding_format": "base64"}),
    )
    .await
    .json();
    // 8 little-endian f32s: 32 bytes, 44 base64 characters.
    assert_eq!(base64["data"][0]["embedding"].as_str().unwrap().len(), 44);
    let unknown = post(
        e.addr(),
        "/v1/embeddings",
        &json!({"model": "other", "input": "x"}),
    )
    .await;
    assert_eq!(unknown.status, 404);
}

#[tokio::test]
async fn responses_stream_the_event_sequence_vllm_emits() {
    let e = engine(|_| {}).await;
    let body =
        json!({"model": "sim-model", "input": "tell me", "max_output_tokens": 3, "stream": true});
    let reply = post(e.addr(), "/v1/responses", &body).await;
    assert_eq!(reply.status, 200);
    let text = reply.text();
    let events: Vec<(String, Value)> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (kind, data) = e.split_once('\n').unwrap();
            let kind = kind.strip_prefix("event: ").unwrap().to_owned();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], kind);
            (kind, data)
        })
        .collect();
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
    );
    for (i, (_, d)) in events.iter().enumerate() {
        assert_eq!(d["sequence_number"], i);
    }
    let deltas: String = events[4..7]
        .iter()
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(events[7].1["text"], deltas);
    let whole = post(
        e.addr(),
        "/v1/responses",
        &json!({"model": "sim-model", "input": "tell me", "max_output_tokens": 3}),
    )
    .await
    .json();
    assert_eq!(whole["output"][0]["content"][0]["text"], deltas);
    assert_eq!(whole["usage"]["output_tokens"], 3);
    assert_eq!(e.stats().responses_requests, 2);
}

/// Once `/v1/load_lora_adapter` loaded an adapter, vLLM serves requests naming it (the
/// answer names it as its `model`); unloaded, it is an unknown model again.
#[tokio::test]
async fn requests_may_name_a_loaded_lora_adapter() {
    let e = engine(|_| {}).await;
    let chat =
        json!({"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let completion = json!({"model": "sql", "prompt": "hi", "max_tokens": 2});
    let unknown = post(e.addr(), "/v1/completions", &completion).await;
    assert_eq!(unknown.status, 404, "{}", unknown.text());
    assert!(error_message(&unknown).contains("The model `sql` does not exist."));

    let load = post(
        e.addr(),
        "/v1/load_lora_adapter",
        &json!({"lora_name": "sql", "lora_path": "/adapters/sql"}),
    )
    .await;
    assert_eq!(load.status, 200, "{}", load.text());
    let whole = post(e.addr(), "/v1/completions", &completion).await;
    assert_eq!(whole.status, 200, "{}", whole.text());
    assert_eq!(whole.json()["model"], "sql");
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let stream = post(e.addr(), "/v1/chat/completions", &streamed).await;
    assert_eq!(stream.status, 200, "{}", stream.text());
    let events = stream.events();
    assert!(events.len() > 2);
    for event in events.iter().filter(|e| e.is_object()) {
        assert_eq!(event["model"], "sql", "{event}");
    }
    let tokenized = post(
        e.addr(),
        "/tokenize",
        &json!({"model": "sql", "prompt": "a b"}),
    )
    .await;
    assert_eq!(tokenized.status, 200, "{}", tokenized.text());
    // The base model is still served under its own name.
    let base = post(
        e.addr(),
        "/v1/completions",
        &json!({"model": "sim-model", "prompt": "hi"}),
    )
    .await;
    assert_eq!(base.json()["model"], "sim-model");

    let unload = post(
        e.addr(),
        "/v1/unload_lora_adapter",
        &json!({"lora_name": "sql"}),
    )
    .await;
    assert_eq!(unload.status, 200);
    assert_eq!(
        post(e.addr(), "/v1/chat/completions", &chat).await.status,
        404
    );
}

// ---------------------------------------------------------------- SGLang /generate

async fn sglang(role: SimRole) -> SimEngine {
    engine(|c| {
        c.kv_mode = KvMode::Sglang(role);
        c.bootstrap_timeout = Duration::from_millis(300);
    })
    .await
}

fn with_rooms(mut body: Value, port: u16, rooms: Value) -> Value {
    match &rooms {
        Value::Array(r) => {
            body["bootstrap_host"] = json!(vec!["127.0.0.1"; r.len()]);
            body["bootstrap_port"] = json!(vec![port; r.len()]);
        }
        _ => {
            body["bootstrap_host"] = json!("127.0.0.1");
            body["bootstrap_port"] = json!(port);
        }
    }
    body["bootstrap_room"] = rooms;
    body
}

#[tokio::test]
async fn generate_hands_kv_over_by_room_single_and_batch() {
    let (p, d) = (
        sglang(SimRole::Prefill).await,
        sglang(SimRole::Decode).await,
    );
    let port = p.bootstrap_addr().unwrap().port();
    let single = with_rooms(
        json!({"text": "a b c d", "sampling_params": {"max_new_tokens": 4}, "return_logprob": true}),
        port,
        json!(7),
    );
    let (pr, dr) = tokio::join!(
        post(p.addr(), "/generate", &single),
        post(d.addr(), "/generate", &single)
    );
    let (pv, dv) = (pr.json(), dr.json());
    // The prefill answers its one token and the prompt's logprobs; the decode the
    // whole generation, and no prompt logprobs (it computed no prompt).
    assert_eq!(pv["meta_info"]["completion_tokens"], 1);
    assert_eq!(
        pv["meta_info"]["input_token_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        4
    );
    assert_eq!(dv["meta_info"]["completion_tokens"], 4);
    assert_eq!(dv["meta_info"]["input_token_logprobs"], json!([]));
    assert_eq!(
        dv["meta_info"]["finish_reason"],
        json!({"type": "length", "length": 4})
    );
    assert!(
        dv["text"]
            .as_str()
            .unwrap()
            .starts_with(pv["text"].as_str().unwrap())
    );

    let batch = with_rooms(
        json!({"input_ids": [tokenize("one two"), tokenize("three four five")], "sampling_params": {"max_new_tokens": 2}, "stream": true}),
        port,
        json!([11, 12]),
    );
    let (pr, dr) = tokio::join!(
        post(p.addr(), "/generate", &batch),
        post(d.addr(), "/generate", &batch)
    );
    assert_eq!(pr.status, 200, "{}", pr.text());
    let events = dr.events();
    assert_eq!(events.last(), Some(&json!("[DONE]")));
    let finals: Vec<&Value> = events
        .iter()
        .filter(|e| !e["meta_info"]["finish_reason"].is_null() && e.is_object())
        .collect();
    assert_eq!(finals.len(), 2);
    let mut indices: Vec<u64> = finals
        .iter()
        .map(|e| e["index"].as_u64().unwrap())
        .collect();
    indices.sort_unstable();
    assert_eq!(indices, [0, 1]);
    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!((ps.generate_requests, ds.generate_requests), (2, 2));
    assert_eq!(ds.remote_decodes, 2);
    assert_eq!(ps.kv_transfers_pending, 0);
}

/// A streamed `/generate` answer, rendered event by event: each element's events carry
/// one token more each, in step order, and its last one is the whole answer's element;
/// with `unterminated_event`, the first event is followed by the event that never ends.
#[tokio::test]
async fn generate_streams_each_element_token_by_token() {
    let (p, d) = (
        sglang(SimRole::Prefill).await,
        sglang(SimRole::Decode).await,
    );
    let port = p.bootstrap_addr().unwrap().port();
    let body = |stream: bool, rooms: Value| {
        with_rooms(
            json!({"text": ["one two", "three four five"], "sampling_params": {"max_new_tokens": 5}, "return_logprob": true, "stream": stream}),
            port,
            rooms,
        )
    };
    let run = |b: Value| {
        let (p, d) = (&p, &d);
        async move {
            let (pr, dr) = tokio::join!(
                post(p.addr(), "/generate", &b),
                post(d.addr(), "/generate", &b)
            );
            assert_eq!(pr.status, 200, "{}", pr.text());
            assert_eq!(dr.status, 200, "{}", dr.text());
            dr
        }
    };
    let whole = run(body(false, json!([51, 52]))).await.json();
    let events = run(body(true, json!([53, 54]))).await.events();
    assert_eq!(events.len(), 2 * 5 + 1);
    assert_eq!(events.last(), Some(&json!("[DONE]")));
    for (i, event) in events[..10].iter().enumerate() {
        // Step by step, the elements in turn.
        let (step, index) = (i / 2 + 1, i % 2);
        assert_eq!(event["index"], index, "{event}");
        assert_eq!(event["meta_info"]["completion_tokens"], step, "{event}");
        let ids = event["output_ids"].as_array().unwrap();
        assert_eq!(
            ids[..],
            whole[index]["output_ids"].as_array().unwrap()[..step]
        );
        if step == 5 {
            for key in ["text", "output_ids"] {
                assert_eq!(event[key], whole[index][key], "{key}");
            }
            assert_eq!(
                event["meta_info"]["finish_reason"],
                json!({"type": "length", "length": 5})
            );
        } else {
            assert!(event["meta_info"]["finish_reason"].is_null(), "{event}");
        }
    }

    d.set_faults(Faults {
        unterminated_event: Some(200_000),
        ..Faults::default()
    });
    let cut = run(body(true, json!([55, 56]))).await.text();
    let (first, rest) = cut.split_once("\n\n").unwrap();
    let first: Value = serde_json::from_str(first.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(first["meta_info"]["completion_tokens"], 1);
    assert!(rest.starts_with("data: {\"text\":\"xxx"), "{}", &rest[..40]);
    assert_eq!(rest.len(), 200_000);
    assert!(!rest.contains('\n'));
}

/// `sampling_params.n`: B prompts times n samples are B·n requests, each taking its
/// element of the bootstrap fields as SGLang expands them: B·n distinct rooms hand
/// every sample's KV over; a room per prompt repeats (a list is repeated per sample)
/// and is refused as the collision it is; a scalar room R is R, R + 1, ...
#[tokio::test]
async fn generate_samples_fail_under_p_d_as_on_sglang() {
    let sampled = |stream: bool| json!({"text": ["one two", "three four five"], "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 0.7}, "stream": stream});
    // Under P/D, SGLang 0.5.23's tokenizer manager sends a prompt's samples with the
    // prompt's room: a distinct room per sample, as a scalar or a list, still collides.
    let (p, d) = (
        sglang(SimRole::Prefill).await,
        sglang(SimRole::Decode).await,
    );
    let port = p.bootstrap_addr().unwrap().port();
    for rooms in [json!([21, 22, 23, 24]), json!(31)] {
        let b = with_rooms(sampled(false), port, rooms);
        for e in [&p, &d] {
            let r = post(e.addr(), "/generate", &b).await;
            assert_eq!(r.status, 500, "{}", r.text());
            assert!(
                error_message(&r).contains("Duplicate or cancelled bootstrap room"),
                "{}",
                r.text()
            );
        }
    }
    // One room per prompt repeats in SGLang's own expansion of the fields first.
    let b = with_rooms(sampled(false), port, json!([41, 42]));
    for e in [&p, &d] {
        let r = post(e.addr(), "/generate", &b).await;
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(error_message(&r).contains("twice"), "{}", r.text());
    }
    assert_eq!(p.stats().kv_transfers_pending, 0);
    assert_eq!(d.stats().remote_decodes, 0);
}

#[tokio::test]
async fn generate_with_a_wrong_room_fails_on_both_sides() {
    let (p, d) = (
        sglang(SimRole::Prefill).await,
        sglang(SimRole::Decode).await,
    );
    let port = p.bootstrap_addr().unwrap().port();
    let body = |room: u64| with_rooms(json!({"text": "a b c"}), port, json!(room));
    let (one, two) = (body(1), body(2));
    let (pr, dr) = tokio::join!(
        post(p.addr(), "/generate", &one),
        post(d.addr(), "/generate", &two)
    );
    assert_eq!((pr.status, dr.status), (500, 500));
    assert!(
        sglang_error_message(&dr).contains("no prefill for room 2"),
        "{}",
        dr.text()
    );
    assert_eq!(d.stats().kv_pull_failures, 1);
    // A vLLM engine has no `/generate`.
    let vllm = engine(|_| {}).await;
    assert_eq!(
        post(vllm.addr(), "/generate", &json!({"text": "a"}))
            .await
            .status,
        404
    );
}
