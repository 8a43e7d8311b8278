//! vLLM 0.33's prompt-token reuse over NIXL (issue #32, item 2), with the real
//! `disagg-proxy serve` binary in front of simulated vLLM engines over loopback: the
//! prefill leg asks for `return_token_ids`, the decode leg carries the prefill's ids in
//! `kv_transfer_params.prompt_token_ids` and the decode tokenizes nothing; a client's
//! forged ids never reach the decode; a prefill's malformed or oversized ids are dropped
//! and counted, the request still served; `--prompt-token-reuse off`, and `auto` before a
//! decode older than 0.33, leave the legs as they were.

#![allow(missing_docs)] // a test binary

use disagg_sim::{Faults, KvMode, SimConfig, SimEngine};
use serde_json::{Value, json};

mod common;
use common::{Proxy, post};

async fn engine(version: &str) -> SimEngine {
    SimEngine::start(SimConfig {
        kv_mode: KvMode::Nixl,
        version: version.to_owned(),
        ..SimConfig::default()
    })
    .await
    .expect("start a simulated engine")
}

const MESSAGES: &str = "the quick brown fox jumps over the lazy dog again and again";

fn chat(stream: bool, extra: Value) -> String {
    let mut body = json!({
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": "you are terse"},
            {"role": "user", "content": MESSAGES},
        ],
        "max_tokens": 12,
        "stream": stream,
    });
    for (k, v) in extra.as_object().expect("an object") {
        body[k] = v.clone();
    }
    body.to_string()
}

/// The prompt's ids as the prefill engine's own tokenizer makes them (what its answer
/// carries as `prompt_token_ids`).
async fn prompt_ids(p: &SimEngine) -> Value {
    let a = post(
        &p.url(),
        "/tokenize",
        &json!({"messages": [
            {"role": "system", "content": "you are terse"},
            {"role": "user", "content": MESSAGES},
        ]})
        .to_string(),
    )
    .await;
    a.json()["tokens"].clone()
}

/// The body of the one chat request `engine` received.
fn leg(engine: &SimEngine) -> Value {
    let chats: Vec<_> = engine
        .requests()
        .into_iter()
        .filter(|r| r.path == "/v1/chat/completions")
        .collect();
    assert_eq!(chats.len(), 1, "one chat leg");
    chats[0].body.clone()
}

#[tokio::test]
async fn reused_ids_reach_the_decode_which_tokenizes_nothing_streamed_or_not() {
    for stream in [false, true] {
        let (p, d) = (engine("0.33.0").await, engine("0.33.0").await);
        // `auto` is the default: both engines report vLLM 0.33.0.
        let proxy = Proxy::start(&p, &d, &[]).await;
        let a = post(
            &proxy.url(),
            "/v1/chat/completions",
            &chat(stream, json!({})),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));

        let prefill = leg(&p);
        assert_eq!(prefill["return_token_ids"], json!(true));
        let decode = leg(&d);
        // The prefill's ids, as its tokenizer made them, on the decode's dict; the
        // client's own body otherwise (no `return_token_ids` it did not send).
        let want = prompt_ids(&p).await;
        assert!(want.as_array().is_some_and(|l| l.len() > 10), "{want}");
        assert_eq!(decode["kv_transfer_params"]["prompt_token_ids"], want);
        assert_eq!(
            decode["kv_transfer_params"]["do_remote_prefill"],
            json!(true)
        );
        assert!(decode.get("return_token_ids").is_none(), "{decode}");

        let ds = d.stats();
        assert_eq!(ds.chat_prompts_tokenized, 0, "the decode tokenized nothing");
        assert_eq!(ds.prompt_ids_reused, 1);
        assert_eq!(
            ds.remote_decodes, 1,
            "the KV still moved, and matched the ids"
        );
        assert_eq!(p.stats().chat_prompts_tokenized, 1);
        assert_eq!(
            proxy.metric("disagg_prompt_token_reuse_sent_total").await,
            1
        );
        assert_eq!(
            proxy
                .metric("disagg_prompt_token_reuse_refused_total")
                .await,
            0
        );

        // The client sees no prompt ids it did not ask for.
        if stream {
            let events = a.events();
            assert!(events.len() > 2);
            for e in events.iter().filter(|e| *e != "[DONE]") {
                let v: Value = serde_json::from_str(e).expect("a JSON event");
                assert!(v["prompt_token_ids"].is_null(), "{e}");
            }
            assert!(!a.chat_content().is_empty());
        } else {
            let v = a.json();
            assert!(v.get("prompt_token_ids").is_none(), "{v}");
            assert!(!a.chat_content().is_empty());
        }
        // The same answer as the decode alone, tokenizing the messages itself.
        let alone = post(&d.url(), "/v1/chat/completions", &chat(false, json!({}))).await;
        assert_eq!(a.chat_content(), alone.chat_content());
    }
}

#[tokio::test]
async fn a_client_asking_for_token_ids_gets_them_from_the_decode() {
    for stream in [false, true] {
        let (p, d) = (engine("0.33.0").await, engine("0.33.0").await);
        let proxy = Proxy::start(&p, &d, &[]).await;
        let a = post(
            &proxy.url(),
            "/v1/chat/completions",
            &chat(stream, json!({"return_token_ids": true})),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(leg(&d)["return_token_ids"], json!(true));
        let got = if stream {
            let first: Value = serde_json::from_str(&a.events()[0]).expect("a JSON event");
            first["prompt_token_ids"].clone()
        } else {
            a.json()["prompt_token_ids"].clone()
        };
        assert_eq!(got, prompt_ids(&p).await, "stream {stream}");
        assert_eq!(d.stats().chat_prompts_tokenized, 0);
    }
}

#[tokio::test]
async fn a_clients_forged_prompt_token_ids_never_reach_the_decode() {
    let forged = json!({"kv_transfer_params": {"prompt_token_ids": [5, 6, 7]}});
    for reuse in ["on", "off"] {
        let (p, d) = (engine("0.33.0").await, engine("0.33.0").await);
        let proxy = Proxy::start(&p, &d, &["--prompt-token-reuse", reuse]).await;
        let a = post(
            &proxy.url(),
            "/v1/chat/completions",
            &chat(false, forged.clone()),
        )
        .await;
        assert_eq!(a.status, 200, "{reuse}: {}", a.text());
        let ids = &leg(&d)["kv_transfer_params"]["prompt_token_ids"];
        let prefill_ids = &leg(&p)["kv_transfer_params"]["prompt_token_ids"];
        assert!(prefill_ids.is_null(), "{reuse}: {prefill_ids}");
        match reuse {
            "on" => assert_eq!(*ids, prompt_ids(&p).await),
            _ => {
                assert!(ids.is_null(), "{reuse}: {ids}");
                assert_eq!(d.stats().chat_prompts_tokenized, 1);
            }
        }
        assert_eq!(d.stats().remote_decodes, 1, "{reuse}");
    }
}

#[tokio::test]
async fn a_prefills_malformed_or_oversized_ids_are_dropped_and_counted() {
    // Over the ceiling of 2^20 ids (about 2 MB, under the prefill answer's 8 MiB).
    let oversized: &'static str =
        Box::leak(format!("[{}1]", "1,".repeat(1 << 20)).into_boxed_str());
    let bad: [&'static str; 6] = [
        "[-1,5]",
        "[]",
        "\"1 2 3\"",
        "[1.5]",
        "[4294967296]",
        oversized,
    ];
    let (p, d) = (engine("0.33.0").await, engine("0.33.0").await);
    let proxy = Proxy::start(&p, &d, &["--prompt-token-reuse", "on"]).await;
    for (i, ids) in bad.iter().enumerate() {
        p.set_faults(Faults {
            prompt_token_ids: Some(ids),
            ..Faults::default()
        });
        let a = post(
            &proxy.url(),
            "/v1/chat/completions",
            &chat(false, json!({})),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
        let n = i as u64 + 1;
        let ds = d.stats();
        assert_eq!(ds.chat_prompts_tokenized, n, "the decode tokenized");
        assert_eq!((ds.prompt_ids_reused, ds.remote_decodes), (0, n));
        assert_eq!(
            proxy
                .metric("disagg_prompt_token_reuse_refused_total")
                .await,
            n
        );
    }
    for r in d.requests() {
        assert!(
            r.body["kv_transfer_params"]
                .get("prompt_token_ids")
                .is_none()
        );
    }
    assert_eq!(
        proxy.metric("disagg_prompt_token_reuse_sent_total").await,
        0
    );
}

#[tokio::test]
async fn off_and_auto_before_an_older_decode_leave_the_legs_alone() {
    for (version, flags) in [
        ("0.33.0", &["--prompt-token-reuse", "off"][..]),
        ("0.32.1", &[][..]),
    ] {
        let (p, d) = (engine(version).await, engine(version).await);
        let proxy = Proxy::start(&p, &d, flags).await;
        let a = post(
            &proxy.url(),
            "/v1/chat/completions",
            &chat(false, json!({})),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert!(leg(&p).get("return_token_ids").is_none(), "{version}");
        assert!(
            leg(&d)["kv_transfer_params"]
                .get("prompt_token_ids")
                .is_none()
        );
        assert_eq!(d.stats().chat_prompts_tokenized, 1, "{version}");
        assert_eq!(d.stats().remote_decodes, 1);
    }
}
