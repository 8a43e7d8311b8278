//! Engine answers and handoffs checked before they are used, with the real
//! `disagg-proxy serve` binary in front of simulated engines over loopback: a prefill's
//! partial vLLM NIXL handoff never reaches the decode (which it would kill or hang, as
//! vLLM 0.33's does), a room per prompt of an SGLang batch
//! (and `n > 1`, which SGLang's engines cannot carry, refused before them), engine indexes
//! checked against the request, reshaped SSE events under a size cap, and an engine
//! whose `/tokenize` hangs ejected like any failing leg.

#![allow(missing_docs)] // a test binary

use std::time::Duration;

use disagg_sim::{Faults, KvMode, PartialKv, SimConfig, SimEngine, SimRole};
use serde_json::json;

mod common;
use common::{Proxy, completion, get, post};

const COMPLETIONS: &str = "/v1/completions";

async fn engine(config: SimConfig) -> SimEngine {
    SimEngine::start(config)
        .await
        .expect("start a simulated engine")
}

// === partial vLLM NIXL handoffs ===

/// Four blocks of sixteen tokens.
fn prompt() -> String {
    (0..64).map(|i| format!("w{i} ")).collect()
}

/// A chat request for `prompt()`.
fn chat(stream: bool) -> String {
    json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": prompt()}],
        "max_tokens": 4,
        "stream": stream,
    })
    .to_string()
}

/// Every partial shape, on completions streamed and not and on chat, through a proxy
/// with `missing_kv` (`None`: the default): the decode never gets a partial dict, and
/// the outcome is `expect`'s (given the path and whether it streamed).
async fn partial_handoffs(missing_kv: Option<&str>, expect: impl Fn(&common::Answer, &str, bool)) {
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let mut flags = vec!["--decode-timeout", "5"];
    if let Some(m) = missing_kv {
        // A failed request blames its prefill, which would be ejected after five:
        // every shape is to reach it here.
        flags.extend(["--missing-kv", m, "--eject-after", "0"]);
    }
    let proxy = Proxy::start(&p, &d, &flags).await;
    let mut sent = 0;
    for shape in PartialKv::ALL {
        p.set_faults(Faults {
            partial_kv_params: Some(shape),
            ..Faults::default()
        });
        let requests = [
            (COMPLETIONS, completion(&prompt(), 4, false), false),
            (COMPLETIONS, completion(&prompt(), 4, true), true),
            ("/v1/chat/completions", chat(true), true),
        ];
        for (path, body, stream) in requests {
            let a = post(&proxy.url(), path, &body).await;
            expect(&a, path, stream);
            sent += 1;
            assert_eq!(
                proxy.metric("disagg_invalid_handoffs_total").await,
                sent,
                "{shape:?}"
            );
        }
    }
    // The prefill answered each with its partial dict; the decode never saw one, and
    // lives.
    assert_eq!(p.stats().kv_params_returned, sent);
    for r in d.requests() {
        assert!(
            r.body.get("kv_transfer_params").is_none(),
            "the decode got {}",
            r.body
        );
    }
    let ds = d.stats();
    assert_eq!((ds.engine_core_deaths, ds.stuck_kv_waits), (0, 0), "{ds:?}");
    assert_eq!(get(&d.url(), "/health").await.status, 200);
    // The warning names the prefill endpoint and what its handoff lacked.
    let log = proxy.log();
    let line = log
        .lines()
        .find(|l| l.contains("incomplete KV handoff") && l.contains("remote_block_ids"))
        .unwrap_or_else(|| panic!("no warning in\n{log}"));
    assert!(line.contains(&p.url()), "{line}");
}

#[tokio::test]
async fn a_partial_handoff_never_reaches_the_decode_which_computes_the_prompt() {
    let expected = disagg_sim::generate(&prompt(), 4, 0).concat();
    partial_handoffs(None, |a, path, stream| {
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("none"));
        if path == COMPLETIONS {
            assert_eq!(a.content(), expected, "stream: {stream}");
        } else {
            assert_eq!(a.events().last().map(String::as_str), Some("[DONE]"));
        }
    })
    .await;
}

#[tokio::test]
async fn a_partial_handoff_fails_the_request_under_missing_kv_fail() {
    partial_handoffs(Some("fail"), |a, _, _| {
        a.assert_error(502, "prefill_failed");
        let message = a.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(message.contains("incomplete"), "{message}");
    })
    .await;
}

/// A complete handoff with the keys vLLM 0.33 added goes on as the prefill wrote it.
#[tokio::test]
async fn a_complete_handoff_still_reaches_the_decode_verbatim() {
    let (p, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let proxy = Proxy::start(&p, &d, &[]).await;
    let a = post(&proxy.url(), COMPLETIONS, &completion(&prompt(), 4, false)).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    let sent = &d.requests()[0].body["kv_transfer_params"];
    assert_eq!(sent["remote_engine_id"], p.engine_id());
    assert_eq!(sent["do_remote_prefill"], json!(true));
    assert_eq!(d.stats().remote_decodes, 1);
    assert_eq!(proxy.metric("disagg_invalid_handoffs_total").await, 0);
}

// === SGLang: rooms for every expansion, indexes, event sizes ===

async fn sglang(role: SimRole, faults: Faults) -> SimEngine {
    engine(SimConfig {
        kv_mode: KvMode::Sglang(role),
        bootstrap_timeout: Duration::from_secs(5),
        faults,
        ..SimConfig::default()
    })
    .await
}

/// The proxy with `--connector sglang` in front of `p` (its bootstrap port given) and
/// `d`.
async fn sglang_proxy(p: &SimEngine, d: &SimEngine) -> Proxy {
    let port = p.bootstrap_addr().expect("a bootstrap server").port();
    Proxy::start_args(&[
        "--connector".to_owned(),
        "sglang".to_owned(),
        "--prefill".to_owned(),
        p.url(),
        port.to_string(),
        "--decode".to_owned(),
        d.url(),
    ])
    .await
}

/// SGLang's expansion of a list of rooms for B prompts times n samples
/// (`_normalize_bootstrap_params`): repeated n times, its first B·n entries.
/// Batches on `/generate` and on completions: the legs carry a distinct room per
/// prompt, the same on both legs, and the request succeeds. Sampling a prompt more than
/// once (`n > 1`) is refused with 400 before any engine is asked: SGLang 0.5.23 gives a
/// prompt's samples one room whatever the request carries, and the simulator, which
/// does the same, fails such a request even with a distinct room per sample.
#[tokio::test]
async fn a_batch_gets_a_room_per_prompt_and_samples_are_refused_before_the_engines() {
    let (p, d) = (
        sglang(SimRole::Prefill, Faults::default()).await,
        sglang(SimRole::Decode, Faults::default()).await,
    );
    let proxy = sglang_proxy(&p, &d).await;
    let generate = json!({"text": ["one two", "three four five"], "sampling_params": {"max_new_tokens": 3, "temperature": 0.7}});
    let completions = json!({"model": "sim-model", "prompt": ["one two", "three four five"], "max_tokens": 3, "temperature": 0.7});
    for (path, body) in [("/generate", generate), (COMPLETIONS, completions)] {
        for stream in [false, true] {
            p.clear_requests();
            d.clear_requests();
            let mut body = body.clone();
            body["stream"] = json!(stream);
            let a = post(&proxy.url(), path, &body.to_string()).await;
            assert_eq!(a.status, 200, "{path}: {}", a.text());
            let (pr, dr) = (&p.requests()[0], &d.requests()[0]);
            assert_eq!(pr.body, dr.body, "{path}: the same body on both legs");
            let rooms: Vec<u64> =
                serde_json::from_value(pr.body["bootstrap_room"].clone()).expect("a list of rooms");
            let distinct: std::collections::HashSet<_> = rooms.iter().collect();
            assert_eq!((rooms.len(), distinct.len()), (2, 2), "{path}: {rooms:?}");
            if path == "/generate" && !stream {
                assert_eq!(a.json().as_array().map(Vec::len), Some(2));
            }
        }
    }
    p.clear_requests();
    d.clear_requests();
    let sampled = [
        (
            "/generate",
            json!({"text": ["one two", "three"], "sampling_params": {"max_new_tokens": 3, "n": 2}}),
            "sampling_params.n",
        ),
        (
            COMPLETIONS,
            json!({"model": "sim-model", "prompt": ["one two", "three"], "max_tokens": 3, "n": 2}),
            "n",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "sim-model", "messages": [{"role": "user", "content": "one two"}], "max_tokens": 3, "n": 3}),
            "n",
        ),
    ];
    for (path, body, param) in sampled {
        let a = post(&proxy.url(), path, &body.to_string()).await;
        assert_eq!(a.status, 400, "{path}: {}", a.text());
        assert_eq!(a.json()["error"]["param"], param, "{path}");
    }
    assert!(p.requests().is_empty() && d.requests().is_empty());
    assert_eq!(p.stats().kv_transfers_pending, 0);
    // The engine itself cannot carry them: even a distinct room per sample collides,
    // since its tokenizer manager sends a prompt's samples with the prompt's room.
    let port = p.bootstrap_addr().unwrap().port();
    let mut per_sample =
        json!({"text": ["one two", "three four five"], "sampling_params": {"n": 2}});
    per_sample["bootstrap_host"] = json!(vec!["127.0.0.1"; 4]);
    per_sample["bootstrap_port"] = json!(vec![port; 4]);
    per_sample["bootstrap_room"] = json!([5, 6, 7, 8]);
    let r = post(&p.url(), "/generate", &per_sample.to_string()).await;
    assert_eq!(r.status, 500, "{}", r.text());
    assert!(
        r.text().contains("Duplicate or cancelled bootstrap room"),
        "{}",
        r.text()
    );
}

/// A prefill whose `/generate` answer names a sequence the request does not have fails
/// that request with 502 naming the prefill; the proxy allocates nothing for it and
/// serves on.
#[tokio::test]
async fn an_out_of_range_index_fails_the_request_not_the_proxy() {
    for index in [4_000_000_000_000u64, 20_000_000] {
        let faults = Faults {
            generate_index: Some(index),
            ..Faults::default()
        };
        let (p, d) = (
            sglang(SimRole::Prefill, faults).await,
            sglang(SimRole::Decode, Faults::default()).await,
        );
        let proxy = sglang_proxy(&p, &d).await;
        let body = json!({"text": ["one two", "three"], "sampling_params": {"max_new_tokens": 2}, "return_logprob": true, "stream": true});
        let a = post(&proxy.url(), "/generate", &body.to_string()).await;
        a.assert_error(502, "prefill_failed");
        let message = a.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(
            message.contains(&index.to_string()) && message.contains(&p.url()),
            "{message}"
        );
        let health = tokio::time::timeout(Duration::from_secs(1), get(&proxy.url(), "/health"))
            .await
            .expect("the proxy answers /health within a second");
        assert_eq!(health.status, 200);
        // The same request without the fault goes through.
        p.set_faults(Faults::default());
        let a = post(&proxy.url(), "/generate", &body.to_string()).await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
}

/// The decode's stream, reshaped (the prefill's logprobs merged in), with one event
/// that does not end: under the 8 MiB ceiling it goes through whole; past it the
/// stream ends with an error event naming the ceiling, and the decode leg is dropped.
#[tokio::test]
async fn an_endless_event_is_held_up_to_the_ceiling() {
    const CEILING: usize = 8 * 1024 * 1024;
    let body = json!({"text": "one two three", "sampling_params": {"max_new_tokens": 4}, "return_logprob": true, "stream": true}).to_string();
    for size in [8_000_000usize, 32_000_000] {
        let faults = Faults {
            unterminated_event: Some(size),
            ..Faults::default()
        };
        let (p, d) = (
            sglang(SimRole::Prefill, Faults::default()).await,
            sglang(SimRole::Decode, faults).await,
        );
        let proxy = sglang_proxy(&p, &d).await;
        let a = post(&proxy.url(), "/generate", &body).await;
        assert_eq!(a.status, 200);
        let text = a.text();
        // The first event came merged: the prompt's logprobs from the prefill.
        let first = a.events().into_iter().next().expect("a first event");
        let first: serde_json::Value = serde_json::from_str(&first).expect("JSON");
        assert_eq!(
            first["meta_info"]["input_token_logprobs"]
                .as_array()
                .map(Vec::len),
            Some(3)
        );
        if size <= CEILING {
            assert!(a.body.len() > size, "{}", a.body.len());
            assert!(!text.contains("decode_stream_failed"));
        } else {
            assert!(a.body.len() < CEILING + 64 * 1024, "{}", a.body.len());
            let last = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
            assert!(
                last.contains("decode_stream_failed") && last.contains(&CEILING.to_string()),
                "{}",
                &last[..last.len().min(300)]
            );
            // The decode leg was dropped before the engine had sent its event.
            assert!(
                common::eventually(Duration::from_secs(5), || d.stats().cancelled == 1).await,
                "{:?}",
                d.stats()
            );
        }
        assert_eq!(get(&proxy.url(), "/health").await.status, 200);
    }
}

// === a hung /tokenize ===

/// `--tokenize engine` over two prefill engines, one of them hung (`/tokenize` and its
/// completions never answer): each request that asks it for token ids waits the
/// tokenize budget and counts against it as a failed leg would; after `--eject-after`
/// of them it is ejected, and requests stop asking it. The requests themselves are
/// routed without ids and served by the other engine.
#[tokio::test]
async fn an_engine_whose_tokenize_hangs_is_ejected() {
    let hung = engine(SimConfig {
        faults: Faults {
            hang: true,
            hang_tokenize: true,
            ..Faults::default()
        },
        ..SimConfig::default()
    })
    .await;
    let (b, d) = (
        engine(SimConfig::default()).await,
        engine(SimConfig::default()).await,
    );
    let proxy = Proxy::start_args(&[
        "--prefill".to_owned(),
        hung.url(),
        "--prefill".to_owned(),
        b.url(),
        "--decode".to_owned(),
        d.url(),
        "--prefill-policy".to_owned(),
        "kv_events".to_owned(),
        "--tokenize".to_owned(),
        "engine".to_owned(),
        "--tokenize-timeout".to_owned(),
        "0.2".to_owned(),
        "--eject-after".to_owned(),
        "2".to_owned(),
        "--ejection-time".to_owned(),
        "60".to_owned(),
    ])
    .await;
    let url = proxy.url();
    // A request whose prefill leg the hung engine takes never ends: each runs on its
    // own, and the test waits only for the ones served.
    let mut served = 0;
    let mut pending = Vec::new();
    for i in 0..8 {
        let (url, body) = (
            url.clone(),
            completion(&format!("{} {i}", prompt()), 2, false),
        );
        let mut task = tokio::spawn(async move { post(&url, COMPLETIONS, &body).await });
        match tokio::time::timeout(Duration::from_secs(1), &mut task).await {
            Ok(answer) => {
                let a = answer.expect("the request task");
                assert_eq!(a.status, 200, "{}", a.text());
                served += 1;
            }
            Err(_) => pending.push(task),
        }
    }
    // Asked twice (the first and third requests, in turn with the other engine), then
    // ejected: never asked again, nor routed to.
    assert_eq!(hung.stats().tokenize_requests, 2, "{}", proxy.log());
    assert!(!proxy.routes_to("prefill", &hung.url()).await);
    assert!(served >= 7, "{served} served");
    assert_eq!(proxy.metric("disagg_tokenize_failures_total").await, 2);
    for task in pending {
        task.abort();
    }
}
