//! The engine's whole HTTP surface through the proxy's `PdService`, against simulated
//! engines over loopback: the model list and cards built from the engines' own,
//! routes forwarded unchanged (tokenize, detokenize, embeddings), a streamed
//! `/v1/responses` served by a decode engine alone, admin routes refused by default and
//! fanned out to every engine once opened, and SGLang's native `/generate` over P/D.

#[path = "../support/mod.rs"]
mod support;

use std::time::Duration;

use disagg_core::{Endpoint, Role};
use disagg_http::RouteTable;
use disagg_sim::{Faults, SimConfig, tokenize};
use serde_json::{Value, json};
use support::*;

/// A model card or list without its permission ids, which vLLM makes anew for every
/// answer (`modelperm-` and a random uuid).
fn stable(mut v: Value) -> Value {
    fn strip(card: &mut Value) {
        for p in card["permission"].as_array_mut().into_iter().flatten() {
            p.as_object_mut().map(|p| p.remove("id"));
        }
    }
    match v["data"].as_array_mut() {
        Some(cards) => cards.iter_mut().for_each(strip),
        None => strip(&mut v),
    }
    v
}

fn engines(n: usize) -> Vec<SimConfig> {
    (0..n).map(|_| SimConfig::default()).collect()
}

#[tokio::test]
async fn the_model_list_and_cards_are_the_engines_own() {
    let stack = Stack::start().await;
    let own = get(&stack.d().url(), "/v1/models").await.json();
    let listed = get(&stack.url, "/v1/models").await;
    assert_eq!(listed.status, 200);
    assert_eq!(stable(listed.json()), stable(own.clone()));

    let card = get(&stack.url, "/v1/models/sim-model").await;
    assert_eq!(card.status, 200, "{}", card.text());
    assert_eq!(stable(card.json()), stable(own["data"][0].clone()));
    for key in ["root", "parent", "max_model_len", "permission"] {
        assert!(card.json().get(key).is_some(), "{key} missing");
    }

    let unknown = get(&stack.url, "/v1/models/no-such-model").await;
    assert_openai_error(&unknown, 404, "model_not_found");
    assert!(unknown.text().contains("sim-model"), "{}", unknown.text());
}

#[tokio::test]
async fn a_declared_name_no_engine_lists_gets_its_engines_card_fields() {
    let stack = Stack::builder()
        .decode(vec![SimConfig {
            max_model_len: 4096,
            ..SimConfig::default()
        }])
        .build()
        .await;
    // The decode engine also declared under another name (`--served-model URL=alias`),
    // which the engine itself does not list.
    let alias = Endpoint::new(&format!("{}@0", stack.d().url()), Role::Decode)
        .unwrap()
        .with_models(["alias"]);
    stack.source.insert(alias);
    let own = get(&stack.d().url(), "/v1/models").await.json();
    let card = get(&stack.url, "/v1/models/alias").await;
    assert_eq!(card.status, 200, "{}", card.text());
    let mut expect = stable(own["data"][0].clone());
    expect["id"] = json!("alias");
    assert_eq!(stable(card.json()), expect);
    assert_eq!(card.json()["root"], "sim-model");
    assert_eq!(card.json()["max_model_len"], 4096);
    let list = get(&stack.url, "/v1/models").await.json();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["sim-model", "alias"]);
}

#[tokio::test]
async fn tokenize_and_detokenize_round_trip_through_the_proxy() {
    let stack = Stack::start().await;
    let text = "the prefill engine computes the prompt";
    let t = post(
        &stack.url,
        "/tokenize",
        json!({"model": "sim-model", "prompt": text}).to_string(),
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(t.status, 200, "{}", t.text());
    assert_eq!(t.json()["tokens"], json!(tokenize(text)));
    let d = post(
        &stack.url,
        "/detokenize",
        json!({"model": "sim-model", "tokens": t.json()["tokens"]}).to_string(),
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(d.json(), json!({"prompt": text}));
    // Forwarded to the decode engine (the tokenizer is the same on both sides), never
    // to the prefill.
    assert_eq!(stack.d().stats().tokenize_requests, 1);
    assert_eq!(stack.d().stats().detokenize_requests, 1);
    assert_eq!(stack.p().stats().tokenize_requests, 0);
    let version = get(&stack.url, "/version").await;
    assert_eq!(version.json(), json!({"version": "0.33.0"}));
}

#[tokio::test]
async fn an_embeddings_request_is_answered_as_the_engine_answers_it() {
    let stack = Stack::start().await;
    let body = json!({"model": "sim-model", "input": ["one two", "three"]}).to_string();
    let direct = post(&stack.d().url(), "/v1/embeddings", body.clone(), &[])
        .await
        .json();
    let proxied = post(&stack.url, "/v1/embeddings", body, &[]).await;
    assert_eq!(proxied.status, 200);
    assert_eq!(proxied.json()["data"], direct["data"]);
    assert_eq!(stack.d().stats().embeddings_requests, 2);
}

/// `/v1/responses` is disaggregated since vLLM 0.33 takes a handoff there: a streamed
/// response is relayed as the decode streams it, after a prefill leg; one that keeps
/// state (`store`) is served by a decode engine alone, since vLLM keeps responses in one
/// server's memory.
#[tokio::test]
async fn a_streamed_response_is_disaggregated_and_a_stored_one_served_by_a_decode_alone() {
    let stack = Stack::start().await;
    let body =
        json!({"model": "sim-model", "input": "tell me", "max_output_tokens": 3, "stream": true});
    let direct = post(&stack.d().url(), "/v1/responses", body.to_string(), &[]).await;
    let proxied = post(&stack.url, "/v1/responses", body.to_string(), &[]).await;
    assert_eq!(proxied.status, 200, "{}", proxied.text());
    assert_eq!(proxied.header("x-disagg-handoff"), Some("kv"));
    assert!(
        proxied
            .header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream"))
    );
    let kinds = |a: &Answer| -> Vec<String> {
        a.text()
            .lines()
            .filter_map(|l| l.strip_prefix("event: ").map(str::to_owned))
            .collect()
    };
    assert_eq!(kinds(&proxied), kinds(&direct));
    assert_eq!(
        kinds(&proxied).last().map(String::as_str),
        Some("response.incomplete")
    );
    assert_eq!(stack.d().stats().responses_requests, 2);
    // The prefill leg: one request to the prefill engine.
    assert_eq!(stack.p().stats().responses_requests, 1);

    let mut stored = body.clone();
    stored["store"] = json!(true);
    let proxied = post(&stack.url, "/v1/responses", stored.to_string(), &[]).await;
    assert_eq!(proxied.status, 200, "{}", proxied.text());
    assert_eq!(proxied.header("x-disagg-handoff"), Some("direct"));
    assert_eq!(stack.d().stats().responses_requests, 3);
    assert_eq!(stack.p().stats().responses_requests, 1);
}

#[tokio::test]
async fn forwarding_to_a_dead_engine_is_a_502_in_openai_format() {
    let (dead, _held) = held_dead_url();
    let stack = Stack::builder()
        .prefill(engines(1))
        .build_with_dead_decode(dead)
        .await;
    let a = post(
        &stack.url,
        "/tokenize",
        json!({"prompt": "x"}).to_string(),
        &[],
    )
    .await;
    assert_openai_error(&a, 502, "decode_failed");
}

#[tokio::test]
async fn an_admin_route_is_refused_by_default() {
    let stack = Stack::start().await;
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"}).to_string();
    let a = post(&stack.url, "/v1/load_lora_adapter", load, &[]).await;
    assert_openai_error(&a, 403, "admin_route_closed");
    assert!(a.text().contains("--admin-routes"), "{}", a.text());
    let r = post(&stack.url, "/reset_prefix_cache", "", &[]).await;
    assert_openai_error(&r, 403, "admin_route_closed");
    for e in stack.prefill.iter().chain(&stack.decode) {
        assert_eq!(e.stats().admin_requests, 0);
        assert!(e.lora_adapters().is_empty());
    }
}

#[tokio::test]
async fn an_opened_admin_route_reaches_every_engine_and_reports_each() {
    let stack = Stack::builder()
        .prefill(engines(1))
        .decode(engines(2))
        .service(|c| c.routes = RouteTable::default().admin_routes(true))
        .build()
        .await;
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"}).to_string();
    let a = post(&stack.url, "/v1/load_lora_adapter", load, &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let results = a.json()["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), 3);
    let roles: Vec<&str> = results
        .iter()
        .map(|r| r["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["prefill", "decode", "decode"]);
    for (r, e) in results
        .iter()
        .zip(stack.prefill.iter().chain(&stack.decode))
    {
        assert_eq!(r["endpoint"], e.url());
        assert_eq!(r["status"], 200);
    }
    for e in stack.prefill.iter().chain(&stack.decode) {
        assert_eq!(e.lora_adapters(), ["sql"]);
    }
    // The model list shows the adapter at once: the fan-out dropped the cached list.
    let models = get(&stack.url, "/v1/models").await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["sim-model", "sql"]);

    // One engine fails its part: the answer says which, the others' results stand.
    stack.decode[1].set_faults(Faults {
        admin_status: Some(500),
        ..Faults::default()
    });
    let unload = json!({"lora_name": "sql"}).to_string();
    let a = post(&stack.url, "/v1/unload_lora_adapter", unload, &[]).await;
    assert_openai_error(&a, 502, "fan_out_failed");
    let v = a.json();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&stack.decode[1].url()),
        "{v}"
    );
    let statuses: Vec<&Value> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["status"])
        .collect();
    assert_eq!(statuses, [&json!(200), &json!(200), &json!(500)]);
    assert!(stack.prefill[0].lora_adapters().is_empty());
    assert!(stack.decode[0].lora_adapters().is_empty());
    assert_eq!(stack.decode[1].lora_adapters(), ["sql"]);

    // Every engine refusing alike is the client's error, with the engines' status.
    stack.decode[1].set_faults(Faults::default());
    let again = json!({"lora_name": "never-loaded"}).to_string();
    let a = post(&stack.url, "/v1/unload_lora_adapter", again, &[]).await;
    let own = post(
        &stack.d().url(),
        "/v1/unload_lora_adapter",
        json!({"lora_name": "never-loaded"}).to_string(),
        &[],
    )
    .await;
    assert!(own.status.is_client_error());
    assert_openai_error(&a, own.status.as_u16(), "fan_out_refused");
}

/// Serves `svc` on a loopback port until the returned sender is dropped.
async fn serve(svc: disagg_http::PdService) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(
        disagg_http::server::Builder::new().serve(listener, svc, async {
            let _ = rx.await;
        }),
    );
    (url, tx)
}

#[tokio::test]
async fn services_built_from_one_config_share_the_model_list() {
    // Two services from clones of one config, as `serve --threads 2` builds its event
    // loops: a fan-out through one drops the list the other cached.
    let stack = Stack::builder()
        .prefill(engines(1))
        .decode(engines(1))
        .build()
        .await;
    let mut config = disagg_http::PdServiceConfig::default();
    config.routes = RouteTable::default().admin_routes(true);
    let (a, _stop_a) = serve(disagg_http::PdService::with_config(
        stack.orchestrator.clone(),
        config.clone(),
    ))
    .await;
    let (b, _stop_b) = serve(disagg_http::PdService::with_config(
        stack.orchestrator.clone(),
        config,
    ))
    .await;
    let ids = |v: Value| -> Vec<String> {
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(ids(get(&a, "/v1/models").await.json()), ["sim-model"]);
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"}).to_string();
    let loaded = post(&b, "/v1/load_lora_adapter", load, &[]).await;
    assert_eq!(loaded.status, 200, "{}", loaded.text());
    // Within the list's 10 s lifetime, the other service shows the adapter at once.
    assert_eq!(
        ids(get(&a, "/v1/models").await.json()),
        ["sim-model", "sql"]
    );
}

// ---------------------------------------------------------------- SGLang /generate

async fn sglang_stack() -> Stack {
    Stack::builder()
        .protocol(Protocol::Sglang)
        .config(|c| c.decode_head_timeout = Duration::from_secs(10))
        .build()
        .await
}

#[tokio::test]
async fn sglang_generate_single_is_served_over_pd_with_the_prompt_logprobs() {
    let stack = sglang_stack().await;
    let body = json!({"text": "a b c d", "sampling_params": {"max_new_tokens": 4}, "return_logprob": true});
    let a = post(&stack.url, "/generate", body.to_string(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    let v = a.json();
    assert_eq!(v["meta_info"]["completion_tokens"], 4);
    // The prompt's logprobs are the prefill's, merged into the decode's answer.
    assert_eq!(
        v["meta_info"]["input_token_logprobs"]
            .as_array()
            .map(Vec::len),
        Some(4)
    );
    let (p, d) = (stack.p().stats(), stack.d().stats());
    assert_eq!((p.generate_requests, d.generate_requests), (1, 1));
    assert_eq!(d.remote_decodes, 1);
    assert_eq!(d.local_prefills, 0);
}

#[tokio::test]
async fn sglang_generate_batches_stream_over_pd_a_room_per_element() {
    let stack = sglang_stack().await;
    let body = json!({
        "input_ids": [tokenize("one two"), tokenize("three four five")],
        "sampling_params": {"max_new_tokens": 3},
        "stream": true,
    });
    let a = post(&stack.url, "/generate", body.to_string(), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    let events = a.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut finished: Vec<u64> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter(|e| !e["meta_info"]["finish_reason"].is_null())
        .map(|e| e["index"].as_u64().unwrap())
        .collect();
    finished.sort_unstable();
    assert_eq!(finished, [0, 1]);
    let text = json!({"text": ["alpha beta", "gamma"], "sampling_params": {"max_new_tokens": 2}});
    let b = post(&stack.url, "/generate", text.to_string(), &[]).await;
    assert_eq!(b.status, 200, "{}", b.text());
    assert_eq!(b.json().as_array().map(Vec::len), Some(2));
    // Two batches, each decoded from the prefill's KV (the engines check every
    // element's room: a wrong one fails both legs), none computed locally, and no
    // transfer left waiting.
    let (p, d) = (stack.p().stats(), stack.d().stats());
    assert_eq!((p.generate_requests, d.generate_requests), (2, 2));
    assert_eq!(d.remote_decodes, 2);
    assert_eq!(d.local_prefills, 0);
    assert_eq!(p.kv_transfers_pending, 0);
}
