//! What vLLM and SGLang engines accept, and what vLLM does with a beam
//! search, a grammar and the headers of a request, over real loopback
//! sockets.

mod common;

use std::time::Duration;

use common::*;
use disagg_sim::{KvMode, SimConfig, SimEngine, SimRole, generate};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const PROMPT: &str = "the words of a prompt that spans more than one block of sixteen tokens so that \
    the prefill holds two blocks";

async fn engine(kv_mode: KvMode, tweak: impl FnOnce(&mut SimConfig)) -> SimEngine {
    let mut config = SimConfig {
        kv_mode,
        bootstrap_timeout: Duration::from_millis(300),
        ..SimConfig::default()
    };
    tweak(&mut config);
    SimEngine::start(config).await.unwrap()
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The bodies the brief of the proxy's fixes names, each refused by every
/// vLLM engine with a 400 in vLLM's shape before any KV work, or accepted.
#[tokio::test]
async fn vllm_engines_refuse_what_vllm_refuses() {
    let table = [
        (
            json!({"logprob_token_ids": [3]}),
            Some("`logprobs` must be set to true"),
        ),
        (
            json!({"top_logprobs": 2}),
            Some("`logprobs` must be set to true"),
        ),
        (
            json!({"top_logprobs": -5, "logprobs": true}),
            Some("`top_logprobs` must be a positive value or -1"),
        ),
        (
            json!({"stream_options": {"include_usage": true}}),
            Some("`stream=True`"),
        ),
        (
            json!({"prompt_logprobs": 1, "stream": true}),
            Some("`prompt_logprobs` are not available when `stream=True`"),
        ),
        (
            json!({"top_logprobs": 21, "logprobs": true}),
            Some("greater than max allowed: 20"),
        ),
        (
            json!({"max_tokens": 0}),
            Some("max_tokens must be at least 1"),
        ),
        (
            json!({"max_tokens": "abc"}),
            Some("max_tokens: Input should be a valid integer"),
        ),
        (
            json!({"max_tokens": 1.5}),
            Some("max_tokens: Input should be a valid integer"),
        ),
        (json!({"n": 0}), Some("n must be at least 1")),
        (
            json!({"n": 2, "temperature": 0}),
            Some("n must be 1 when using greedy sampling"),
        ),
        (
            json!({"stop": [""]}),
            Some("stop cannot contain an empty string"),
        ),
        (
            json!({"stop": 5}),
            Some("stop: Input should be a valid string"),
        ),
        (
            json!({"stop_token_ids": ["a"]}),
            Some("stop_token_ids: Input should be a valid integer"),
        ),
        (
            json!({"stream": "maybe"}),
            Some("stream: Input should be a valid boolean"),
        ),
        (
            json!({"temperature": 3}),
            Some("temperature must be in [0, 2]"),
        ),
        (json!({"stream": "yes"}), None),
        (json!({"stream": 1}), None),
        (json!({"stream": "off"}), None),
        (json!({"max_tokens": "2"}), None),
        (json!({"top_logprobs": 20, "logprobs": "true"}), None),
    ];
    // A vLLM engine of every mode, as a decode or plain engine would get it.
    let modes = [
        KvMode::Nixl,
        KvMode::NixlPush,
        KvMode::Mooncake(SimRole::Decode),
        KvMode::Lmcache(SimRole::Decode),
    ];
    for mode in modes {
        let e = engine(mode, |_| {}).await;
        for (extra, refusal) in &table {
            let reply = post(e.addr(), CHAT, &chat(extra.clone())).await;
            match refusal {
                Some(why) => {
                    assert_eq!(reply.status, 400, "{mode:?} {extra}: {}", reply.text());
                    let v = reply.json();
                    assert_eq!(v["error"]["type"], "BadRequestError");
                    assert_eq!(v["error"]["param"], Value::Null);
                    let message = error_message(&reply);
                    assert!(message.contains(why), "{mode:?} {extra}: {message}");
                }
                // Accepted: past validation, whatever the mode then asks (a
                // Mooncake decode needs its parameters, an LMCache decode its KV).
                None => assert!(
                    reply.status != 400 || error_message(&reply).starts_with("Mooncake:"),
                    "{mode:?} {extra}: {}",
                    reply.text()
                ),
            }
        }
        let s = e.stats();
        assert_eq!((s.kv_pull_failures, s.blocks_held), (0, 0), "{mode:?}");
    }
    // A plain vLLM engine serves the accepted ones, lax values read as such.
    let e = engine(KvMode::Nixl, |_| {}).await;
    let reply = post(e.addr(), CHAT, &chat(json!({"stream": "yes"}))).await;
    assert_eq!(reply.events().last().unwrap(), "[DONE]");
    let reply = post(
        e.addr(),
        COMPLETIONS,
        &json!({"prompt": PROMPT, "max_tokens": "3", "stream": "off"}),
    )
    .await;
    assert_eq!(reply.json()["usage"]["completion_tokens"], 3);
    // The server's --max-logprobs is a knob.
    let wide = engine(KvMode::Nixl, |c| c.max_logprobs = 50).await;
    let reply = post(
        wide.addr(),
        CHAT,
        &chat(json!({"top_logprobs": 21, "logprobs": true})),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// SGLang's laxer ranges, through a real prefill/decode pair.
#[tokio::test]
async fn sglang_serves_what_vllm_refuses() {
    let p = engine(KvMode::Sglang(SimRole::Prefill), |_| {}).await;
    let d = engine(KvMode::Sglang(SimRole::Decode), |_| {}).await;
    let port = p.bootstrap_addr().unwrap().port();
    for (room, extra) in [
        json!({"max_tokens": 0}),
        json!({"n": 0}),
        json!({"temperature": 3}),
        json!({"top_logprobs": 50, "logprobs": true}),
        json!({"top_logprobs": 50}),
        json!({"stream": "yes"}),
    ]
    .into_iter()
    .enumerate()
    {
        let mut body = chat(extra.clone());
        body["bootstrap_host"] = json!("127.0.0.1");
        body["bootstrap_port"] = json!(port);
        body["bootstrap_room"] = json!(room);
        let (pr, dr) = tokio::join!(post(p.addr(), CHAT, &body), post(d.addr(), CHAT, &body));
        assert_eq!((pr.status, dr.status), (200, 200), "{extra}: {}", dr.text());
    }
    let body = |max_tokens: Value| {
        json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens,
               "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 99})
    };
    // Still refused: a negative count, a type pydantic cannot coerce.
    for bad in [json!(-1), json!("abc")] {
        let r = post(d.addr(), CHAT, &body(bad.clone())).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
    }
}

#[tokio::test]
async fn beam_search_ignores_kv_transfer_params_on_both_roles() {
    let p = engine(KvMode::Nixl, |c| c.engine_id = Some("p".into())).await;
    let d = engine(KvMode::Nixl, |_| {}).await;
    let prefill = json!({"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    let params = post(p.addr(), COMPLETIONS, &prefill).await.json()["kv_transfer_params"].clone();
    assert_eq!(params["remote_engine_id"], "p");
    let held = p.stats().blocks_held;

    // A beam-search prefill keeps nothing and answers no parameters.
    let mut beam = prefill.clone();
    beam["use_beam_search"] = json!(true);
    let r = post(p.addr(), COMPLETIONS, &beam).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["kv_transfer_params"], Value::Null);
    assert_eq!(p.stats().blocks_held, held);

    // A beam-search decode computes its prompt: the blocks it was named stay.
    let decode = json!({"prompt": PROMPT, "max_tokens": 4, "use_beam_search": true, "n": 2,
                        "temperature": 0, "kv_transfer_params": params.clone()});
    let r = post(d.addr(), COMPLETIONS, &decode).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["choices"][0]["text"],
        generate(PROMPT, 4, 0).concat()
    );
    let (ps, ds) = (p.stats(), d.stats());
    assert_eq!(ps.blocks_held, held);
    assert_eq!(ps.side_channel_served, 0);
    assert_eq!(
        (
            ds.local_prefills,
            ds.remote_decodes,
            ds.invalid_kv_params,
            ds.beam_search_requests
        ),
        (1, 0, 0, 1)
    );
    assert_eq!(p.stats().beam_search_requests, 1);
    // Without beam search the same parameters are pulled.
    let mut pulled = decode.clone();
    pulled["use_beam_search"] = json!(false);
    pulled["temperature"] = json!(1.0);
    assert_eq!(post(d.addr(), COMPLETIONS, &pulled).await.status, 200);
    assert_eq!((p.stats().blocks_held, d.stats().remote_decodes), (0, 1));

    // Mooncake: a beam-search prefill needs no transfer id and holds
    // nothing; a beam-search decode needs no parameters.
    let mp = engine(KvMode::Mooncake(SimRole::Prefill), |_| {}).await;
    let md = engine(KvMode::Mooncake(SimRole::Decode), |_| {}).await;
    let beam = json!({"prompt": PROMPT, "max_tokens": 2, "use_beam_search": true,
                      "kv_transfer_params": {"do_remote_decode": true}});
    for e in [&mp, &md] {
        let r = post(e.addr(), COMPLETIONS, &beam).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let s = e.stats();
        assert_eq!(
            (
                s.beam_search_requests,
                s.local_prefills,
                s.kv_transfers_pending
            ),
            (1, 1, 0)
        );
    }
    // A NIXL push prefill likewise holds nothing.
    let pp = engine(KvMode::NixlPush, |_| {}).await;
    let r = post(pp.addr(), COMPLETIONS, &beam).await;
    assert_eq!(r.json()["kv_transfer_params"], Value::Null);
    assert_eq!(pp.stats().blocks_held, 0);
}

#[tokio::test]
async fn grammar_compilations_are_counted_per_engine() {
    let p = engine(KvMode::Nixl, |_| {}).await;
    let d = engine(KvMode::Nixl, |_| {}).await;
    let grammars = [
        json!({"response_format": {"type": "json_object"}}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}}}),
        json!({"structured_outputs": {"choice": ["a", "b"]}}),
        json!({"guided_json": {"type": "object"}}),
        json!({"guided_regex": "[a-z]+"}),
        json!({"guided_choice": ["yes", "no"]}),
        json!({"guided_grammar": "root ::= \"x\""}),
    ];
    for g in &grammars {
        assert_eq!(
            post(d.addr(), CHAT, &chat(g.clone())).await.status,
            200,
            "{g}"
        );
    }
    // No grammar: plain text, or a request refused before the engine took it.
    assert_eq!(
        post(
            d.addr(),
            CHAT,
            &chat(json!({"response_format": {"type": "text"}}))
        )
        .await
        .status,
        200
    );
    let refused = chat(json!({"response_format": {"type": "json_object"}, "max_tokens": 0}));
    assert_eq!(post(d.addr(), CHAT, &refused).await.status, 400);
    assert_eq!(d.stats().grammars_compiled, grammars.len() as u64);
    // A prefill leg that carries none compiles none; one that does, does.
    let leg = |extra: Value| {
        let mut body = chat(extra);
        body["kv_transfer_params"] = json!({"do_remote_decode": true});
        body["max_tokens"] = json!(1);
        body
    };
    assert_eq!(post(p.addr(), CHAT, &leg(json!({}))).await.status, 200);
    assert_eq!(p.stats().grammars_compiled, 0);
    assert_eq!(
        post(p.addr(), CHAT, &leg(grammars[0].clone())).await.status,
        200
    );
    assert_eq!(p.stats().grammars_compiled, 1);
    // SGLang engines do not count.
    let s = engine(KvMode::Sglang(SimRole::Decode), |_| {}).await;
    let mut body = chat(grammars[0].clone());
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_room"] = json!(1);
    post(s.addr(), CHAT, &body).await;
    assert_eq!(s.stats().grammars_compiled, 0);
}

#[tokio::test]
async fn recorded_requests_keep_the_headers_of_each_leg() {
    let e = engine(KvMode::Nixl, |c| c.dp_size = 2).await;
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let headers = [
        ("x-request-id", "leg-1"),
        ("X-data-parallel-rank", "1"),
        ("traceparent", traceparent),
    ];
    let r = post_with(e.addr(), CHAT, &headers, &chat(json!({}))).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        post(e.addr(), COMPLETIONS, &json!({"prompt": "x"}))
            .await
            .status,
        200
    );
    let recorded = e.requests();
    assert_eq!(recorded.len(), 2);
    assert_eq!(recorded[0].path, CHAT);
    assert_eq!(recorded[0].header("x-request-id"), Some("leg-1"));
    assert_eq!(recorded[0].header("X-Data-Parallel-Rank"), Some("1"));
    assert_eq!(recorded[0].header("traceparent"), Some(traceparent));
    assert_eq!(recorded[0].body["max_tokens"], 2);
    assert_eq!(recorded[1].header("x-request-id"), None);
    assert_eq!(recorded[1].header("traceparent"), None);
    assert_eq!(e.stats().requests_per_dp_rank, [0, 2]);
}

/// Every choice of a request is built up front: a batch of prompts × `n` beyond 1024
/// choices, or beyond 2^22 tokens to generate, is a 400 in OpenAI's shape on every
/// generation route (SGLang's `/generate` and vLLM's token-in route included), not an
/// allocation of gigabytes.
#[tokio::test]
async fn batches_beyond_the_choice_and_token_ceilings_are_refused() {
    let vllm = engine(KvMode::Nixl, |_| {}).await;
    let sglang = engine(KvMode::Sglang(SimRole::Decode), |_| {}).await;
    let prompts = |n: usize| json!(vec!["a b"; n]);
    let refused = [
        // 9 prompts × n = 128: 1152 choices.
        (
            &vllm,
            COMPLETIONS,
            json!({"prompt": prompts(9), "n": 128, "max_tokens": 1}),
            "1152 choices",
        ),
        // Token-id prompts, counted the same.
        (
            &vllm,
            COMPLETIONS,
            json!({"prompt": vec![vec![20, 21]; 9], "n": 128, "max_tokens": 1}),
            "1152 choices",
        ),
        // More prompts than choices served, refused before they are tokenized.
        (
            &vllm,
            COMPLETIONS,
            json!({"prompt": prompts(1025)}),
            "1025 choices",
        ),
        // 600 choices of up to 8000 tokens: 4.8 million tokens.
        (
            &vllm,
            COMPLETIONS,
            json!({"prompt": prompts(600), "max_tokens": 8000}),
            "4800000 generated tokens",
        ),
        (
            &vllm,
            "/inference/v1/generate",
            json!({"token_ids": vec![vec![20, 21]; 9], "sampling_params": {"n": 128, "max_tokens": 1}}),
            "1152 choices",
        ),
        (
            &sglang,
            COMPLETIONS,
            json!({"prompt": prompts(9), "n": 128, "max_tokens": 1}),
            "1152 choices",
        ),
        (
            &sglang,
            "/generate",
            json!({"text": prompts(9), "sampling_params": {"n": 128, "max_new_tokens": 1}}),
            "1152 choices",
        ),
        (
            &sglang,
            "/generate",
            json!({"input_ids": vec![vec![20, 21]; 1025]}),
            "1025 choices",
        ),
        (
            &sglang,
            "/generate",
            json!({"text": prompts(600), "sampling_params": {"max_new_tokens": 8000}}),
            "4800000 generated tokens",
        ),
    ];
    for (e, path, body, needle) in refused {
        let reply = post(e.addr(), path, &body).await;
        assert_eq!(reply.status, 400, "{path}: {}", reply.text());
        let message = error_message(&reply);
        assert!(
            message.contains(needle),
            "{path}: {message:?} lacks {needle:?}"
        );
        assert_eq!(reply.json()["error"]["type"], "BadRequestError");
    }
    // At the ceiling: 8 prompts × n = 128 are 1024 choices.
    let reply = post(
        vllm.addr(),
        COMPLETIONS,
        &json!({"prompt": prompts(8), "n": 128, "max_tokens": 1}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["choices"].as_array().unwrap().len(), 1024);
}

/// A completions request with an explicit `"max_tokens": null` fails as on vLLM,
/// whose completions handler asserts a limit for every output: streamed, a 200 head,
/// one error event, then `[DONE]`; not streamed, a 500 in vLLM's shape. Absent, the
/// limit is 16; a chat's null is no limit, and is served.
#[tokio::test]
async fn vllm_completions_fail_on_a_null_max_tokens() {
    let e = engine(KvMode::Nixl, |_| {}).await;
    let streamed = post(
        e.addr(),
        COMPLETIONS,
        &json!({"prompt": PROMPT, "max_tokens": null, "stream": true}),
    )
    .await;
    assert_eq!(streamed.status, 200, "{}", streamed.text());
    let events = streamed.events();
    assert_eq!(events.len(), 2, "{events:?}");
    let error = &events[0]["error"];
    assert!(
        error["message"].as_str().unwrap().contains("max_tokens"),
        "{error}"
    );
    assert_eq!(error["code"], 500, "{error}");
    assert!(events[0].get("choices").is_none(), "{events:?}");
    assert_eq!(events[1], "[DONE]");

    let whole = post(
        e.addr(),
        COMPLETIONS,
        &json!({"prompt": PROMPT, "max_tokens": null}),
    )
    .await;
    assert_eq!(whole.status, 500, "{}", whole.text());
    let v = whole.json();
    assert_eq!(v["error"]["type"], "InternalServerError", "{v}");
    assert_eq!(v["error"]["code"], 500, "{v}");
    assert!(error_message(&whole).contains("max_tokens"), "{v}");

    // Absent: vLLM's default of 16.
    let absent = post(e.addr(), COMPLETIONS, &json!({"prompt": PROMPT})).await;
    assert_eq!(absent.json()["usage"]["completion_tokens"], 16);
    // A chat's null is "no limit": served.
    let chat_null = post(e.addr(), CHAT, &chat(json!({"max_tokens": null}))).await;
    assert_eq!(chat_null.status, 200, "{}", chat_null.text());
}

/// The `error` object of a refused request, checked for vLLM's 400 shape.
fn bad_request(reply: &Reply) -> Value {
    assert_eq!(reply.status, 400, "{}", reply.text());
    let error = reply.json()["error"].clone();
    assert_eq!(error["type"], "BadRequestError", "{error}");
    assert_eq!(error["code"], 400, "{error}");
    error
}

/// A prompt or a limit beyond the context is refused with vLLM's wording
/// (`OpenAIServing._validate_input`): the prompt first, with `param`
/// `input_tokens`, then the limit, with `param` `max_tokens`, each message
/// ending as `VLLMValidationError` renders its parameter and value.
#[tokio::test]
async fn context_overflow_is_refused_with_vllm_wording_and_param() {
    let n = disagg_sim::tokenize(PROMPT).len();
    let room = engine(KvMode::Nixl, |c| c.max_model_len = (n + 10) as u32).await;
    let len = n + 10;
    let too_large = |m: usize| {
        format!(
            "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum context length is {len} tokens and your request has {n} input tokens ({m} > {len} - {n}). (parameter=max_tokens, value={m})"
        )
    };
    let reply = post(
        room.addr(),
        COMPLETIONS,
        &json!({"prompt": PROMPT, "max_tokens": 11}),
    )
    .await;
    let error = bad_request(&reply);
    assert_eq!(error["message"], too_large(11), "{error}");
    assert_eq!(error["param"], "max_tokens", "{error}");
    // Exactly the room left is served.
    let fits = post(
        room.addr(),
        COMPLETIONS,
        &json!({"prompt": PROMPT, "max_tokens": 10}),
    )
    .await;
    assert_eq!(fits.status, 200, "{}", fits.text());

    // Chat: `max_completion_tokens` is checked under the same name and param.
    let c = disagg_sim::tokenize("hi there").len();
    let chat_room = engine(KvMode::Nixl, |cfg| cfg.max_model_len = (c + 1) as u32).await;
    let reply = post(
        chat_room.addr(),
        CHAT,
        &chat(json!({"max_completion_tokens": 5})),
    )
    .await;
    let error = bad_request(&reply);
    assert_eq!(
        error["message"],
        format!(
            "'max_tokens' or 'max_completion_tokens' is too large: 5. This model's maximum context length is {} tokens and your request has {c} input tokens (5 > {} - {c}). (parameter=max_tokens, value=5)",
            c + 1,
            c + 1
        ),
        "{error}"
    );
    assert_eq!(error["param"], "max_tokens", "{error}");

    // A prompt that fills the context is refused for its input, with or without a limit.
    let full = engine(KvMode::Nixl, |cfg| cfg.max_model_len = n as u32).await;
    let input = format!(
        "This model's maximum context length is {n} tokens. However, your request has {n} input tokens. Please reduce the length of the input messages. (parameter=input_tokens, value={n})"
    );
    for body in [
        json!({"prompt": PROMPT, "max_tokens": 1}),
        json!({"prompt": PROMPT}),
    ] {
        let reply = post(full.addr(), COMPLETIONS, &body).await;
        let error = bad_request(&reply);
        assert_eq!(error["message"], input, "{body}: {error}");
        assert_eq!(error["param"], "input_tokens", "{body}: {error}");
    }
}

/// An unknown model is a 404 naming `model` as its `param`, as vLLM's
/// `_check_model` answers.
#[tokio::test]
async fn unknown_model_names_the_model_param() {
    let e = engine(KvMode::Nixl, |_| {}).await;
    for (path, body) in [
        (CHAT, chat(json!({"model": "gpt-9"}))),
        (COMPLETIONS, json!({"model": "gpt-9", "prompt": PROMPT})),
    ] {
        let reply = post(e.addr(), path, &body).await;
        assert_eq!(reply.status, 404, "{}", reply.text());
        let error = &reply.json()["error"];
        assert_eq!(error["type"], "NotFoundError", "{error}");
        assert_eq!(error["message"], "The model `gpt-9` does not exist.");
        assert_eq!(error["param"], "model", "{error}");
    }
}

/// The `usage` of each streamed event, `None` where it has none.
fn usages(events: &[Value]) -> Vec<Option<(u64, u64, u64)>> {
    events
        .iter()
        .filter(|e| e.is_object())
        .map(|e| {
            e.get("usage").map(|u| {
                let [p, c, t] = ["prompt_tokens", "completion_tokens", "total_tokens"]
                    .map(|k| u[k].as_u64().unwrap_or_else(|| panic!("{k}: {e}")));
                (p, c, t)
            })
        })
        .collect()
}

/// With `stream_options.continuous_usage_stats` (and `include_usage`), vLLM puts
/// `usage` on every chunk: the prompt's tokens, the chunk's choice's tokens so
/// far (none on chat's role chunks) and their sum; then the final usage chunk.
/// Without `include_usage` the flag does nothing.
#[tokio::test]
async fn continuous_usage_stats_put_usage_on_every_chunk() {
    let e = engine(KvMode::Nixl, |_| {}).await;
    let p = disagg_sim::tokenize("hi there").len() as u64;
    let continuous = json!({"include_usage": true, "continuous_usage_stats": true});
    let reply = post(
        e.addr(),
        CHAT,
        &chat(json!({"n": 2, "max_tokens": 3, "ignore_eos": true, "stream": true, "stream_options": continuous})),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let events = reply.events();
    assert_eq!(events.last(), Some(&json!("[DONE]")));
    let mut expected = vec![Some((p, 0, p)); 2];
    for step in 1..=3 {
        expected.extend([Some((p, step, p + step)); 2]);
    }
    expected.push(Some((p, 6, p + 6)));
    assert_eq!(usages(&events), expected, "{events:?}");
    // The final chunk has no choices; every other one has exactly one.
    let chunks: Vec<&Value> = events.iter().filter(|e| e.is_object()).collect();
    for chunk in &chunks[..chunks.len() - 1] {
        assert_eq!(
            chunk["choices"].as_array().map(Vec::len),
            Some(1),
            "{chunk}"
        );
    }

    // Completions: a batch of two prompts, each choice's own prompt counted.
    let (short, long) = ("hi there", PROMPT);
    let (ps, pl) = (
        disagg_sim::tokenize(short).len() as u64,
        disagg_sim::tokenize(long).len() as u64,
    );
    let reply = post(
        e.addr(),
        COMPLETIONS,
        &json!({"prompt": [short, long], "max_tokens": 2, "ignore_eos": true,
                "stream": true, "stream_options": continuous}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let events = reply.events();
    let mut expected = Vec::new();
    for step in 1..=2 {
        expected.extend([Some((ps, step, ps + step)), Some((pl, step, pl + step))]);
    }
    expected.push(Some((ps + pl, 4, ps + pl + 4)));
    assert_eq!(usages(&events), expected, "{events:?}");

    // `continuous_usage_stats` alone: no usage anywhere.
    let reply = post(
        e.addr(),
        CHAT,
        &chat(json!({"stream": true, "stream_options": {"continuous_usage_stats": true}})),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(
        usages(&reply.events()).iter().all(Option::is_none),
        "{}",
        reply.text()
    );
}
