//! Wire shapes, validation, faults and bookkeeping of a single engine.

mod common;

use std::time::Duration;

use common::*;
use disagg_sim::{Faults, SimConfig, SimEngine, Stats, generate, generate_from_ids};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

async fn engine() -> SimEngine {
    SimEngine::start(SimConfig::default()).await.unwrap()
}

fn text(prompt: &str, n: usize) -> String {
    generate(prompt, n, 0).concat()
}

#[tokio::test]
async fn chat_non_stream_shape() {
    let e = engine().await;
    let body = json!({
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": "You are"},
            {"role": "user", "content": [{"type": "text", "text": "a  helpful\nbot"}]}
        ],
        "max_tokens": 5
    });
    let reply = request(
        e.addr(),
        "POST",
        "/v1/chat/completions",
        &[("x-request-id", "abc-123")],
        Some(serde_json::to_vec(&body).unwrap()),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.headers["content-type"], "application/json");
    assert_eq!(reply.headers["x-request-id"], "abc-123");
    let v = reply.json();
    let created = v["created"].as_u64().unwrap();
    assert!(created > 1_600_000_000);
    let expected = json!({
        "id": "chatcmpl-abc-123",
        "object": "chat.completion",
        "created": created,
        "model": "sim-model",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text("You are a helpful bot", 5), "tool_calls": []},
            "logprobs": null,
            "finish_reason": "length",
            "stop_reason": null
        }],
        "usage": {"prompt_tokens": 5, "total_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": null},
        "prompt_logprobs": null,
        "kv_transfer_params": null
    });
    assert_eq!(v, expected);
    // Key order as vLLM renders it.
    let raw = reply.text();
    let order = [
        "\"id\"",
        "\"object\"",
        "\"created\"",
        "\"model\"",
        "\"choices\"",
        "\"usage\"",
        "\"prompt_logprobs\"",
        "\"kv_transfer_params\"",
    ];
    let positions: Vec<usize> = order.iter().map(|k| raw.find(k).unwrap()).collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "{raw}");

    let s = e.stats();
    assert_eq!(s.requests, 1);
    assert_eq!(s.local_prefills, 1);
    assert_eq!(s.active_requests, 0);
    assert_eq!(s.cancelled, 0);
}

#[tokio::test]
async fn completions_non_stream_shape_and_prompt_forms() {
    let e = engine().await;
    let reply = post(
        e.addr(),
        "/v1/completions",
        &json!({"prompt": "one two three", "max_tokens": 4}),
    )
    .await;
    assert_eq!(reply.status, 200);
    let v = reply.json();
    let id = v["id"].as_str().unwrap();
    assert!(id.starts_with("cmpl-") && id.len() > 10, "{id}");
    assert!(reply.headers.get("x-request-id").is_none());
    assert_eq!(v["object"], "text_completion");
    assert_eq!(
        v["choices"],
        json!([{"index": 0, "text": text("one two three", 4), "logprobs": null, "finish_reason": "length", "stop_reason": null, "prompt_logprobs": null}])
    );
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4, "prompt_tokens_details": null})
    );
    assert_eq!(v["kv_transfer_params"], Value::Null);

    // Default max tokens, and no model field.
    let v = post(e.addr(), "/v1/completions", &json!({"prompt": "x"}))
        .await
        .json();
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["model"], "sim-model");

    // A list of prompts: one choice each; n multiplies.
    let v = post(
        e.addr(),
        "/v1/completions",
        &json!({"prompt": ["a b", "c"], "max_tokens": 2, "n": 2}),
    )
    .await
    .json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    assert_eq!(choices[0]["text"], text("a b", 2));
    assert_eq!(choices[2]["text"], text("c", 2));
    assert_ne!(choices[0]["text"], choices[1]["text"]);
    assert_eq!(choices[3]["index"], 3);
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["completion_tokens"], 8);

    // Token ids: the prompt's tokens, as `tokenize` makes them from text.
    let v = post(
        e.addr(),
        "/v1/completions",
        &json!({"prompt": [1, 22, 333], "max_tokens": 3}),
    )
    .await
    .json();
    assert_eq!(
        v["choices"][0]["text"],
        generate_from_ids(&[1, 22, 333], 3, 0).concat()
    );
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    let v = post(
        e.addr(),
        "/v1/completions",
        &json!({"prompt": [[1, 2], [3]], "max_tokens": 3}),
    )
    .await
    .json();
    assert_eq!(
        v["choices"][1]["text"],
        generate_from_ids(&[3], 3, 0).concat()
    );
}

#[tokio::test]
async fn chat_stream_shape() {
    let e = engine().await;
    let body = json!({"messages": [{"role": "user", "content": "stream me"}], "max_completion_tokens": 3, "max_tokens": 99,
        "stream": true, "stream_options": {"include_usage": true}});
    let reply = post(e.addr(), "/v1/chat/completions", &body).await;
    assert_eq!(reply.status, 200);
    assert!(
        reply.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = reply.events();
    assert_eq!(events.len(), 1 + 3 + 1 + 1, "{events:?}");
    let id = events[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for ev in &events[..5] {
        assert_eq!(ev["id"], id);
        assert_eq!(ev["object"], "chat.completion.chunk");
        assert_eq!(ev["model"], "sim-model");
    }
    assert_eq!(
        events[0]["choices"],
        json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}])
    );
    let tokens = generate("stream me", 3, 0);
    for (i, tok) in tokens.iter().enumerate() {
        let choice = &events[1 + i]["choices"][0];
        assert_eq!(choice["delta"], json!({"content": tok}));
        assert_eq!(choice["logprobs"], Value::Null);
        if i < 2 {
            assert_eq!(choice["finish_reason"], Value::Null);
        } else {
            assert_eq!(choice["finish_reason"], "length");
        }
    }
    assert_eq!(events[4]["choices"], json!([]));
    assert_eq!(
        events[4]["usage"],
        json!({"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3})
    );
    assert_eq!(events[5], "[DONE]");
    let s = wait_for(&e, |s| s.active_requests == 0).await;
    assert_eq!(s.cancelled, 0);
}

#[tokio::test]
async fn completions_stream_shape() {
    let e = engine().await;
    let reply = post(
        e.addr(),
        "/v1/completions",
        &json!({"prompt": "p q", "max_tokens": 4, "stream": true}),
    )
    .await;
    let events = reply.events();
    assert_eq!(events.len(), 5);
    let streamed: String = events[..4]
        .iter()
        .map(|ev| {
            assert_eq!(ev["object"], "text_completion");
            ev["choices"][0]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(streamed, text("p q", 4));
    assert_eq!(
        events[0]["choices"][0],
        json!({"index": 0, "text": generate("p q", 1, 0)[0], "logprobs": null, "finish_reason": null, "stop_reason": null, "prompt_token_ids": null, "token_ids": null, "weight_versions": null})
    );
    // vLLM 0.33 sets `kv_transfer_params` on every chunk (null but on a finished
    // prefill's).
    assert_eq!(events[0]["kv_transfer_params"], json!(null));
    assert!(
        events[0]
            .as_object()
            .unwrap()
            .contains_key("kv_transfer_params")
    );
    assert_eq!(events[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(events[4], "[DONE]");
    let non_stream = post(
        e.addr(),
        "/v1/completions",
        &json!({"prompt": "p q", "max_tokens": 4}),
    )
    .await
    .json();
    assert_eq!(non_stream["choices"][0]["text"], streamed);
}

/// `return_token_ids` streams each chunk's new id (and the prompt's ids on the first
/// chunk, top-level for chat, on the choice for completions), and a completion whose
/// token prompt is a prompt followed by the ids generated for it goes on exactly as the
/// unbroken answer did: what a migrated stream's continuation relies on.
#[tokio::test]
async fn streamed_token_ids_continue_exactly() {
    let e = engine().await;
    let messages = json!([{"role": "user", "content": "tell me more"}]);
    let chat = post(
        e.addr(),
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 9, "stream": true, "return_token_ids": true}),
    )
    .await
    .events();
    let prompt: Vec<u64> = chat[0]["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert!(!prompt.is_empty());
    let tokens = &chat[1..10];
    let ids: Vec<u64> = tokens
        .iter()
        .map(|ev| {
            let ids = ev["choices"][0]["token_ids"].as_array().unwrap();
            assert_eq!(ids.len(), 1);
            ids[0].as_u64().unwrap()
        })
        .collect();
    let content: Vec<String> = tokens
        .iter()
        .map(|ev| {
            ev["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    for k in [1, 4, 8] {
        let mut longer = prompt.clone();
        longer.extend_from_slice(&ids[..k]);
        let rest = post(
            e.addr(),
            "/v1/completions",
            &json!({"prompt": longer, "max_tokens": 9 - k, "stream": true, "return_token_ids": true}),
        )
        .await
        .events();
        assert_eq!(rest[0]["choices"][0]["prompt_token_ids"], json!(longer));
        let more: Vec<String> = rest[..9 - k]
            .iter()
            .map(|ev| ev["choices"][0]["text"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(more, content[k..], "continued after {k} tokens");
        let more_ids: Vec<u64> = rest[..9 - k]
            .iter()
            .map(|ev| ev["choices"][0]["token_ids"][0].as_u64().unwrap())
            .collect();
        assert_eq!(more_ids, ids[k..]);
        assert_eq!(rest[1]["choices"][0]["prompt_token_ids"], json!(null));
    }
    // Unasked, no ids.
    let plain = post(
        e.addr(),
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2, "stream": true}),
    )
    .await
    .events();
    assert_eq!(plain[0]["prompt_token_ids"], json!(null));
    assert_eq!(plain[1]["choices"][0]["token_ids"], json!(null));
}

/// vLLM builds each of a chat stream's `n` role chunks with the prompt's ids
/// (`prompt_token_ids=res.prompt_token_ids if request.return_token_ids`, inside its
/// `for i in range(num_choices)`): every role chunk carries them, not only the first.
#[tokio::test]
async fn every_role_chunk_carries_the_prompt_ids() {
    let e = engine().await;
    let messages = json!([{"role": "user", "content": "tell me more"}]);
    let body = json!({"messages": messages, "max_tokens": 2, "n": 3, "stream": true,
                      "return_token_ids": true});
    let events = post(e.addr(), "/v1/chat/completions", &body).await.events();
    let roles: Vec<&Value> = events
        .iter()
        .filter(|ev| ev["choices"][0]["delta"]["role"] == "assistant")
        .collect();
    assert_eq!(roles.len(), 3, "{events:?}");
    let ids = &roles[0]["prompt_token_ids"];
    assert!(ids.as_array().is_some_and(|ids| !ids.is_empty()), "{ids}");
    for (i, role) in roles.iter().enumerate() {
        assert_eq!(role["choices"][0]["index"], i, "{role}");
        assert_eq!(&role["prompt_token_ids"], ids, "{role}");
    }
    // Token chunks carry none.
    for ev in events
        .iter()
        .filter(|ev| ev["choices"][0]["delta"].get("role").is_none())
    {
        if *ev != "[DONE]" {
            assert!(ev.get("prompt_token_ids").is_none(), "{ev}");
        }
    }
}

#[tokio::test]
async fn stream_frames_are_paced_and_separate() {
    let e = SimEngine::start(SimConfig {
        inter_token_delay: Duration::from_millis(30),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let mut conn = Conn::open(e.addr()).await;
    let body =
        serde_json::to_vec(&json!({"prompt": "x", "max_tokens": 4, "stream": true})).unwrap();
    let resp = conn.send("POST", "/v1/completions", &[], Some(body)).await;
    let mut body = resp.into_body();
    let start = std::time::Instant::now();
    let mut frames = Vec::new();
    while let Some(frame) = body.frame().await {
        let data = frame.unwrap().into_data().unwrap();
        frames.push((start.elapsed(), data));
    }
    // 4 tokens + [DONE], one event per frame.
    assert_eq!(frames.len(), 5);
    assert!(
        frames
            .iter()
            .all(|(_, d)| d.starts_with(b"data: ") && d.ends_with(b"\n\n"))
    );
    let spread = frames[3].0 - frames[0].0;
    assert!(spread >= Duration::from_millis(85), "{spread:?}");
}

#[tokio::test]
async fn eos_stop_strings_and_min_tokens() {
    let e = SimEngine::start(SimConfig {
        eos_period: 3,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let prompt = (0..)
        .map(|i| format!("eos {i}"))
        .find(|p| generate(p, 1, 3).is_empty())
        .unwrap();
    let v = post(
        e.addr(),
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8}),
    )
    .await
    .json();
    assert_eq!(v["choices"][0]["text"], "");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 1);
    // ignore_eos and min_tokens keep generating.
    for extra in [json!({"ignore_eos": true}), json!({"min_tokens": 8})] {
        let mut body = json!({"prompt": prompt, "max_tokens": 8});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let v = post(e.addr(), "/v1/completions", &body).await.json();
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{body}");
        assert_eq!(v["usage"]["completion_tokens"], 8);
    }
    // Stop strings.
    let long = post(
        e.addr(),
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 6, "ignore_eos": true}),
    )
    .await
    .json();
    let words: Vec<String> = long["choices"][0]["text"]
        .as_str()
        .unwrap()
        .split(' ')
        .skip(1)
        .map(str::to_owned)
        .collect();
    let stop = words[2].clone();
    let first = words.iter().position(|w| *w == stop).unwrap();
    let v = post(
        e.addr(),
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 6, "ignore_eos": true, "stop": [stop]}),
    )
    .await
    .json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(c["stop_reason"], stop.as_str());
    let kept: String = words[..first].iter().map(|w| format!(" {w}")).collect();
    assert_eq!(c["text"], kept.as_str());
    let v = post(e.addr(), "/v1/completions", &json!({"prompt": prompt, "max_tokens": 6, "ignore_eos": true, "stop": stop, "include_stop_str_in_output": true})).await.json();
    assert_eq!(v["choices"][0]["text"], format!("{kept} {stop}"));
}

#[tokio::test]
async fn validation_errors() {
    let e = engine().await;
    let check = |reply: Reply, status: u16, kind: &str, message: Option<&str>| {
        assert_eq!(reply.status, status, "{}", reply.text());
        let v = reply.json();
        assert_eq!(v["error"]["type"], kind);
        assert_eq!(v["error"]["code"], status);
        // vLLM names `model` as the param of an unknown model's 404, and none here else.
        let unknown_model = message.is_some_and(|m| m.ends_with("does not exist."));
        let param = if unknown_model {
            json!("model")
        } else {
            Value::Null
        };
        assert_eq!(v["error"]["param"], param);
        if let Some(m) = message {
            assert_eq!(v["error"]["message"], m);
        }
    };
    let chat = "/v1/chat/completions";
    let msgs = json!([{"role": "user", "content": "hi"}]);
    check(
        post(
            e.addr(),
            chat,
            &json!({"messages": msgs, "stream_options": {"include_usage": true}}),
        )
        .await,
        400,
        "BadRequestError",
        Some("Stream options can only be defined when `stream=True`."),
    );
    check(
        post(
            e.addr(),
            chat,
            &json!({"messages": msgs, "stream": false, "stream_options": {"include_usage": false}}),
        )
        .await,
        400,
        "BadRequestError",
        None,
    );
    check(
        post(e.addr(), chat, &json!({"model": "gpt-9", "messages": msgs})).await,
        404,
        "NotFoundError",
        Some("The model `gpt-9` does not exist."),
    );
    check(
        request(e.addr(), "POST", chat, &[], Some(b"{not json".to_vec())).await,
        400,
        "BadRequestError",
        None,
    );
    check(
        post(e.addr(), chat, &json!({"messages": msgs, "max_tokens": 0})).await,
        400,
        "BadRequestError",
        None,
    );
    check(
        post(
            e.addr(),
            chat,
            &json!({"messages": msgs, "max_completion_tokens": -1}),
        )
        .await,
        400,
        "BadRequestError",
        None,
    );
    check(
        post(
            e.addr(),
            chat,
            &json!({"messages": msgs, "max_tokens": 2, "min_tokens": 3}),
        )
        .await,
        400,
        "BadRequestError",
        None,
    );
    check(
        post(e.addr(), chat, &json!({"prompt": "no messages"})).await,
        400,
        "BadRequestError",
        None,
    );
    check(
        post(e.addr(), "/v1/completions", &json!({"prompt": ""})).await,
        400,
        "BadRequestError",
        None,
    );
    // Beyond the context: vLLM names `max_tokens` as the param.
    let over = post(
        e.addr(),
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 9000}),
    )
    .await;
    assert_eq!(over.status, 400, "{}", over.text());
    let v = over.json();
    assert_eq!(v["error"]["type"], "BadRequestError", "{v}");
    assert_eq!(v["error"]["param"], "max_tokens", "{v}");
    check(
        post(
            e.addr(),
            "/v1/completions",
            &json!({"prompt": "x", "kv_transfer_params": 3}),
        )
        .await,
        400,
        "BadRequestError",
        None,
    );
    check(
        get(e.addr(), "/nope").await,
        404,
        "NotFoundError",
        Some("Not Found"),
    );
    assert_eq!(
        get(e.addr(), "/nope").await.json(),
        json!({"error": {"message": "Not Found", "type": "NotFoundError", "param": null, "code": 404}})
    );
    // Stream options with stream=true are fine.
    let ok = post(
        e.addr(),
        chat,
        &json!({"messages": msgs, "stream": true, "stream_options": {"include_usage": false}}),
    )
    .await;
    assert_eq!(ok.status, 200);
    let s = e.stats();
    assert_eq!(s.requests, 12);
    assert_eq!(s.active_requests, 0);
    assert_eq!(s.cancelled, 0);
}

#[tokio::test]
async fn health_models_stats() {
    let e = engine().await;
    let health = get(e.addr(), "/health").await;
    assert_eq!(health.status, 200);
    assert!(health.body.is_empty());
    let models = get(e.addr(), "/v1/models").await.json();
    assert_eq!(models["object"], "list");
    let m = &models["data"][0];
    assert_eq!(m["id"], "sim-model");
    assert_eq!(m["object"], "model");
    assert_eq!(m["owned_by"], "vllm");
    assert_eq!(m["root"], "sim-model");
    assert_eq!(m["parent"], Value::Null);
    assert_eq!(m["max_model_len"], 8192);
    assert!(m["created"].is_u64());
    post(
        e.addr(),
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 1}),
    )
    .await;
    wait_for(&e, |s| s.open_connections == 0).await;
    let stats: Stats = serde_json::from_slice(&get(e.addr(), "/stats").await.body).unwrap();
    assert_eq!(stats.requests, 1);
    assert_eq!(stats.open_connections, 1); // the /stats connection itself
    assert_eq!(e.url(), format!("http://{}", e.addr()));
    assert!(!e.engine_id().is_empty());
}

#[tokio::test]
async fn keep_alive_and_connection_count() {
    let e = engine().await;
    let mut conn = Conn::open(e.addr()).await;
    for i in 0..3 {
        let body =
            serde_json::to_vec(&json!({"prompt": format!("k {i}"), "max_tokens": 2})).unwrap();
        let reply = read(conn.send("POST", "/v1/completions", &[], Some(body)).await).await;
        assert_eq!(reply.status, 200);
    }
    let s = e.stats();
    assert_eq!(s.open_connections, 1);
    assert_eq!(s.requests, 3);
    drop(conn);
    wait_for(&e, |s| s.open_connections == 0).await;
}

#[tokio::test]
async fn recorded_requests_are_bounded() {
    let e = SimEngine::start(SimConfig {
        record_requests: 2,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    for i in 0..3 {
        request(
            e.addr(),
            "POST",
            "/v1/completions",
            &[("x-request-id", &format!("r{i}"))],
            Some(serde_json::to_vec(&json!({"prompt": format!("p{i}"), "max_tokens": 1})).unwrap()),
        )
        .await;
    }
    let recorded = e.requests();
    assert_eq!(recorded.len(), 2);
    assert_eq!(recorded[0].path, "/v1/completions");
    assert_eq!(recorded[0].header("X-Request-Id"), Some("r1"));
    assert_eq!(recorded[1].body, json!({"prompt": "p2", "max_tokens": 1}));
    e.clear_requests();
    assert!(e.requests().is_empty());
}

/// The ring keeps its requests within 64 MiB, the oldest forgotten first: 256 bodies
/// of up to 64 MiB each are not held at once.
#[tokio::test]
async fn recorded_requests_are_bounded_in_bytes() {
    let e = engine().await;
    for word in ["a", "b", "c"] {
        // One word of 25 MiB: one prompt token.
        let body = json!({"prompt": word.repeat(25 << 20), "max_tokens": 1});
        let reply = post(e.addr(), "/v1/completions", &body).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let recorded = e.requests();
    let first_letters: Vec<&str> = recorded
        .iter()
        .map(|r| &r.body["prompt"].as_str().unwrap()[..1])
        .collect();
    assert_eq!(
        first_letters,
        ["b", "c"],
        "the newest requests, within 64 MiB"
    );
    let bytes: usize = recorded
        .iter()
        .map(|r| r.body["prompt"].as_str().unwrap().len())
        .sum();
    assert!(bytes <= 64 << 20, "{bytes} bytes of bodies recorded");
    // Small requests are recorded as before.
    let reply = post(e.addr(), "/v1/completions", &json!({"prompt": "d"})).await;
    assert_eq!(reply.status, 200);
    assert_eq!(e.requests().last().unwrap().body, json!({"prompt": "d"}));
}

#[tokio::test]
async fn fault_status() {
    let e = SimEngine::start(SimConfig {
        faults: Faults {
            status: Some(503),
            ..Faults::default()
        },
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let reply = post(e.addr(), "/v1/chat/completions", &json!({"messages": []})).await;
    assert_eq!(reply.status, 503);
    let v = reply.json();
    assert_eq!(v["error"]["code"], 503);
    assert!(v["error"]["type"].as_str().unwrap().ends_with("Error"));
    assert_eq!(get(e.addr(), "/health").await.status, 200);
    assert_eq!(get(e.addr(), "/v1/models").await.status, 200);
    e.set_faults(Faults {
        status: Some(500),
        ..Faults::default()
    });
    let reply = post(e.addr(), "/v1/completions", &json!({"prompt": "x"})).await;
    assert_eq!(reply.json()["error"]["type"], "InternalServerError");
    e.set_faults(Faults::default());
    assert_eq!(
        post(e.addr(), "/v1/completions", &json!({"prompt": "x"}))
            .await
            .status,
        200
    );
    let s = e.stats();
    assert_eq!((s.requests, s.active_requests, s.cancelled), (3, 0, 0));
}

#[tokio::test]
async fn fault_hang_until_client_leaves() {
    let e = engine().await;
    e.set_faults(Faults {
        hang: true,
        ..Faults::default()
    });
    assert!(e.faults().hang);
    let body = serde_json::to_string(&json!({"prompt": "x"})).unwrap();
    let mut stream = tokio::net::TcpStream::connect(e.addr()).await.unwrap();
    stream
        .write_all(
            format!(
                "POST /v1/completions HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    wait_for(&e, |s| s.active_requests == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(e.stats().active_requests, 1);
    assert_eq!(get(e.addr(), "/health").await.status, 200);
    drop(stream);
    let s = wait_for(&e, |s| s.active_requests == 0 && s.open_connections == 0).await;
    assert_eq!(s.cancelled, 1);
}

#[tokio::test]
async fn fault_drop_after_chunks() {
    let e = engine().await;
    e.set_faults(Faults {
        drop_after_chunks: Some(2),
        ..Faults::default()
    });
    // Streaming: two events, then the connection is aborted.
    let mut conn = Conn::open(e.addr()).await;
    let body =
        serde_json::to_vec(&json!({"prompt": "x", "max_tokens": 10, "stream": true})).unwrap();
    let resp = conn.send("POST", "/v1/completions", &[], Some(body)).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut events = 0;
    let mut failed = false;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                let data = f.into_data().unwrap();
                assert!(!data.starts_with(b"data: [DONE]"));
                events += 1;
            }
            Err(_) => {
                failed = true;
                break;
            }
        }
    }
    assert_eq!(events, 2);
    assert!(failed, "the stream must not end cleanly");

    // Non-streaming: the body is cut short.
    let mut conn = Conn::open(e.addr()).await;
    let body = serde_json::to_vec(&json!({"prompt": "x", "max_tokens": 10})).unwrap();
    let resp = conn.send("POST", "/v1/completions", &[], Some(body)).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.into_body().collect().await.is_err());

    let s = wait_for(&e, |s| s.active_requests == 0).await;
    assert_eq!(s.cancelled, 0);
    assert_eq!(s.requests, 2);
}

#[tokio::test]
async fn fault_stall_after_chunks_hangs_mid_answer_until_the_client_leaves() {
    let e = engine().await;
    e.set_faults(Faults {
        stall_after_chunks: Some(2),
        // The stall wins: the connection is never dropped.
        drop_after_chunks: Some(2),
        ..Faults::default()
    });
    assert_eq!(e.faults().stall_after_chunks, Some(2));
    const SILENCE: Duration = Duration::from_millis(350);

    // Streaming: two events, then nothing, on a connection that stays open.
    let mut conn = Conn::open(e.addr()).await;
    let body =
        serde_json::to_vec(&json!({"prompt": "x", "max_tokens": 10, "stream": true})).unwrap();
    let resp = conn.send("POST", "/v1/completions", &[], Some(body)).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    for _ in 0..2 {
        let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert!(data.starts_with(b"data: {"), "{data:?}");
    }
    assert!(
        tokio::time::timeout(SILENCE, body.frame()).await.is_err(),
        "nothing more may arrive"
    );
    let s = e.stats();
    assert_eq!(
        (s.active_requests, s.open_connections, s.cancelled),
        (1, 1, 0)
    );
    drop(body);
    drop(conn);
    let s = wait_for(&e, |s| s.active_requests == 0 && s.open_connections == 0).await;
    assert_eq!(s.cancelled, 1);

    // Non-streaming: the head and half the body, then nothing.
    let mut conn = Conn::open(e.addr()).await;
    let body = serde_json::to_vec(&json!({"prompt": "x", "max_tokens": 10})).unwrap();
    let resp = conn.send("POST", "/v1/completions", &[], Some(body)).await;
    assert_eq!(resp.status(), 200);
    let length: usize = resp.headers()["content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let mut body = resp.into_body();
    let half = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(half.len(), length / 2);
    assert!(tokio::time::timeout(SILENCE, body.frame()).await.is_err());
    assert_eq!(e.stats().active_requests, 1);
    drop(body);
    drop(conn);
    let s = wait_for(&e, |s| s.active_requests == 0 && s.open_connections == 0).await;
    assert_eq!(s.cancelled, 2);

    // Streaming, stalled right after the head.
    e.set_faults(Faults {
        stall_after_chunks: Some(0),
        ..Faults::default()
    });
    let mut conn = Conn::open(e.addr()).await;
    let body = serde_json::to_vec(&json!({"prompt": "x", "stream": true})).unwrap();
    let resp = conn.send("POST", "/v1/completions", &[], Some(body)).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    assert!(tokio::time::timeout(SILENCE, body.frame()).await.is_err());
    drop(body);
    drop(conn);
    let s = wait_for(&e, |s| s.active_requests == 0).await;
    assert_eq!(s.cancelled, 3);

    // Lifted at run time: answers are whole again.
    e.set_faults(Faults::default());
    let reply = post(
        e.addr(),
        "/v1/completions",
        &json!({"prompt": "x", "stream": true}),
    )
    .await;
    assert_eq!(reply.events().last(), Some(&json!("[DONE]")));
    assert_eq!(e.stats().cancelled, 3);
}

#[tokio::test]
async fn fault_malformed_kv_params() {
    let p = engine().await;
    p.set_faults(Faults {
        malformed_kv_params: true,
        ..Faults::default()
    });
    let chat = |params: Value| {
        json!({"messages": [{"role": "user", "content": "some prompt"}], "max_tokens": 1,
               "kv_transfer_params": params})
    };
    let prefill = chat(json!({"do_remote_decode": true, "do_remote_prefill": false}));
    let reply = post(p.addr(), "/v1/chat/completions", &prefill).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let v = reply.json();
    let params = v["kv_transfer_params"].clone();
    assert!(params.is_string(), "{params}");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        text("some prompt", 1)
    );
    let s = p.stats();
    assert_eq!(
        (s.prefill_requests, s.kv_params_returned, s.blocks_held),
        (1, 0, 0)
    );

    // Requests that are not prefills are untouched.
    let plain = json!({"prompt": "some prompt", "max_tokens": 1});
    assert_eq!(
        post(p.addr(), "/v1/completions", &plain).await.json()["kv_transfer_params"],
        Value::Null
    );

    // Copied verbatim onto a decode, the string is refused there.
    let d = engine().await;
    let reply = post(d.addr(), "/v1/chat/completions", &chat(params)).await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    assert!(reply.text().contains("kv_transfer_params"));

    // Lifted at run time: the prefill holds its blocks and names them again.
    p.set_faults(Faults::default());
    let v = post(p.addr(), "/v1/chat/completions", &prefill)
        .await
        .json();
    assert!(
        v["kv_transfer_params"]["remote_block_ids"].is_array(),
        "{v}"
    );
    assert_eq!(p.stats().blocks_held, 1);
}

#[tokio::test]
async fn client_leaving_mid_stream_is_cancelled() {
    let e = SimEngine::start(SimConfig {
        inter_token_delay: Duration::from_millis(10),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let mut conn = Conn::open(e.addr()).await;
    let body = serde_json::to_vec(&json!({"messages": [{"role": "user", "content": "long"}], "max_tokens": 1000, "stream": true})).unwrap();
    let resp = conn
        .send("POST", "/v1/chat/completions", &[], Some(body))
        .await;
    let mut body = resp.into_body();
    for _ in 0..3 {
        body.frame().await.unwrap().unwrap();
    }
    assert_eq!(e.stats().active_requests, 1);
    drop(body);
    drop(conn);
    let s = wait_for(&e, |s| s.active_requests == 0).await;
    assert_eq!(s.cancelled, 1);
    wait_for(&e, |s| s.open_connections == 0).await;
}

#[tokio::test]
async fn shutdown_closes_everything() {
    let e = SimEngine::start(SimConfig {
        faults: Faults {
            hang: true,
            ..Faults::default()
        },
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let addr = e.addr();
    let side = e.side_channel_addr();
    let mut conn = Conn::open(addr).await;
    let body = serde_json::to_vec(&json!({"prompt": "x"})).unwrap();
    let pending = tokio::spawn(async move {
        let resp = conn.sender.send_request(
            http::Request::post("/v1/completions")
                .header("host", "sim")
                .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                .unwrap(),
        );
        resp.await.is_err()
    });
    wait_for(&e, |s| s.active_requests == 1).await;
    e.shutdown().await;
    assert!(
        pending.await.unwrap(),
        "the hung request must fail once the engine is gone"
    );
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    assert!(tokio::net::TcpStream::connect(side).await.is_err());
}

#[tokio::test]
async fn in_process_service_answers_like_the_wire_and_opens_no_connection() {
    use tower::ServiceExt;
    let e = engine().await;
    let body = json!({"model": "sim-model", "prompt": "one two", "max_tokens": 3});
    let over_wire = post(e.addr(), "/v1/completions", &body).await;
    assert_eq!(e.stats().http_connections, 1);

    let req = http::Request::post("/v1/completions")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            serde_json::to_vec(&body).unwrap(),
        )))
        .unwrap();
    let resp = e.service().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        v["choices"][0]["text"],
        over_wire.json()["choices"][0]["text"]
    );
    assert_eq!(v["choices"][0]["text"], text("one two", 3));

    let stats = e.stats();
    assert_eq!(stats.requests, 2);
    assert_eq!(
        stats.http_connections, 1,
        "the in-process call opened no connection"
    );
}

#[tokio::test]
async fn metrics_count_the_requests_waiting_for_the_prefill_slot_and_running() {
    let e = SimEngine::start(SimConfig {
        serial_prefill: true,
        prefill_delay_per_token: Duration::from_millis(100),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let addr = e.addr();
    let body = json!({"model": "sim-model", "prompt": "one two three", "max_tokens": 1});
    let held: Vec<_> = (0..3)
        .map(|_| {
            let body = body.clone();
            tokio::spawn(async move { post(addr, "/v1/completions", &body).await })
        })
        .collect();
    // One computes its prefill, two queue behind it.
    wait_for(&e, |s| s.active_requests == 3 && s.waiting_requests == 2).await;
    let text = get(addr, "/metrics").await.text();
    assert!(
        text.contains("vllm:num_requests_waiting{model_name=\"sim-model\",engine=\"0\"} 2.0\n"),
        "{text}"
    );
    assert!(
        text.contains("vllm:num_requests_running{model_name=\"sim-model\",engine=\"0\"} 1.0\n"),
        "{text}"
    );
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
    let s = e.stats();
    assert_eq!((s.active_requests, s.waiting_requests), (0, 0));
}

#[tokio::test]
async fn past_max_num_seqs_requests_wait_in_the_queue_until_a_running_one_ends() {
    let e = SimEngine::start(SimConfig {
        max_num_seqs: Some(2),
        inter_token_delay: Duration::from_millis(100),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let addr = e.addr();
    let body = json!({"model": "sim-model", "prompt": "one two three", "max_tokens": 3});
    let held: Vec<_> = (0..5)
        .map(|_| {
            let body = body.clone();
            tokio::spawn(async move { post(addr, "/v1/completions", &body).await })
        })
        .collect();
    // Two run, three wait for a place.
    wait_for(&e, |s| s.active_requests == 5 && s.waiting_requests == 3).await;
    let text = get(addr, "/metrics").await.text();
    assert!(
        text.contains("vllm:num_requests_waiting{model_name=\"sim-model\",engine=\"0\"} 3.0\n"),
        "{text}"
    );
    assert!(
        text.contains("vllm:num_requests_running{model_name=\"sim-model\",engine=\"0\"} 2.0\n"),
        "{text}"
    );
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
    let s = e.stats();
    assert_eq!(
        (s.active_requests, s.waiting_requests, s.requests),
        (0, 0, 5)
    );
}
