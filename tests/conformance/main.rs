//! The legs the proxy sends, against simulated engines that check them as vLLM 0.33 and
//! SGLang 0.5.23 do: data-parallel ranks, request ids, the rewriter's dependent fields,
//! values the engines refuse, requests P/D cannot carry, grammars.
//!
//! Each test names an engine behaviour the simulator models (see `disagg_sim`'s crate
//! docs) and a request that a proxy which ignores it gets wrong.

#[path = "../support/mod.rs"]
mod support;

use std::time::Duration;

use disagg_core::orchestrator::KvRelease;
use disagg_sim::SimConfig;
use http::HeaderName;
use support::{Protocol, Stack, assert_openai_error, chat, completion, eventually, get, post};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// A short wait for a peer, so that a leg waiting for KV that never comes fails in
/// seconds rather than the engines' 300 s.
fn impatient() -> SimConfig {
    SimConfig {
        bootstrap_timeout: Duration::from_secs(2),
        ..SimConfig::default()
    }
}

/// A chat body with `extra` top-level fields.
fn chat_with(content: &str, extra: &str) -> String {
    format!(
        r#"{{"model":"sim-model","messages":[{{"role":"user","content":"{content}"}}],"max_tokens":4,{extra}}}"#
    )
}

/// A prefill engine with two data-parallel ranks given without `@RANK`: vLLM places a
/// request that names no rank on a rank of its own choosing, so the proxy must pin the
/// prefill leg to the rank whose engine id the decode waits on, and spread the requests
/// over the ranks.
#[tokio::test]
async fn mooncake_prefill_with_dp_ranks_is_pinned_and_spread() {
    let stack = Stack::builder()
        .protocol(Protocol::Mooncake)
        .prefill(vec![SimConfig {
            dp_size: 2,
            ..impatient()
        }])
        .decode(vec![impatient()])
        .build()
        .await;
    for i in 0..6 {
        let a = post(
            &stack.url,
            CHAT,
            chat(&format!("rank spread {i}"), 4, false),
            &[],
        )
        .await;
        assert_eq!(a.status, 200, "request {i}: {}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    }
    let (p, d) = (stack.p().stats(), stack.d().stats());
    assert_eq!(d.remote_decodes, 6, "every decode fetched the KV");
    assert_eq!(d.kv_pull_failures, 0);
    assert_eq!(p.requests_per_dp_rank, vec![3, 3], "spread over both ranks");
    for leg in stack.p().requests() {
        assert!(
            leg.header("x-data-parallel-rank").is_some(),
            "an unpinned leg"
        );
    }
}

/// SGLang reads ranks from `routed_dp_rank` and `disagg_prefill_dp_rank`: with ranks
/// routed on both sides, every (prefill rank, decode rank) pair must meet, and a prefill
/// pinned off its room must not fail with "follow_bootstrap_room conflict".
#[tokio::test]
async fn sglang_dp_ranks_meet_for_every_pair_of_ranks() {
    let stack = Stack::builder()
        .protocol(Protocol::Sglang)
        .prefill(vec![SimConfig {
            dp_size: 2,
            ..impatient()
        }])
        .decode(vec![SimConfig {
            dp_size: 2,
            ..impatient()
        }])
        .ranks(2, 2)
        .build()
        .await;
    for i in 0..8 {
        let a = post(
            &stack.url,
            COMPLETIONS,
            completion(&format!("pair {i}"), 3, false),
            &[],
        )
        .await;
        assert_eq!(a.status, 200, "request {i}: {}", a.text());
    }
    let (p, d) = (stack.p().stats(), stack.d().stats());
    assert_eq!(p.dp_rank_conflicts, 0);
    assert_eq!(d.remote_decodes, 8);
    // Each side's ranks served half the requests: the routed ranks reached the engines.
    assert_eq!(p.requests_per_dp_rank, vec![4, 4]);
    assert_eq!(d.requests_per_dp_rank, vec![4, 4]);
    for leg in stack.d().requests() {
        let body = &leg.body;
        assert!(body.get("data_parallel_rank").is_none());
        assert!(body.get("data_parallel_rank_decode").is_none());
        assert_eq!(
            body["disagg_prefill_dp_rank"].as_u64().map(|r| r < 2),
            Some(true),
            "the decode is told the prefill's rank: {body}"
        );
    }
}

/// A client's rank fields and headers never reach an engine: on SGLang engines with two
/// ranks they would pin the prefill off its room (a conflict) or send the decode to a
/// rank the proxy did not choose.
#[tokio::test]
async fn client_dp_fields_and_headers_never_reach_an_engine() {
    let stack = Stack::builder()
        .protocol(Protocol::Sglang)
        .prefill(vec![SimConfig {
            dp_size: 2,
            ..impatient()
        }])
        .decode(vec![SimConfig {
            dp_size: 2,
            ..impatient()
        }])
        .config(|c| {
            // Even an operator who forwards these headers does not forward ranks.
            c.forward_headers
                .push(HeaderName::from_static("x-data-parallel-rank"));
            c.forward_headers
                .push(HeaderName::from_static("x-override-disagg-prefill-dp-rank"));
        })
        .build()
        .await;
    let body = chat_with(
        "who picks ranks",
        r#""routed_dp_rank":1,"data_parallel_rank":1,"disagg_prefill_dp_rank":0,"data_parallel_rank_decode":1"#,
    );
    for _ in 0..6 {
        let a = post(
            &stack.url,
            CHAT,
            body.clone(),
            &[
                ("x-data-parallel-rank", "1"),
                ("x-override-disagg-prefill-dp-rank", "0"),
            ],
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(stack.p().stats().dp_rank_conflicts, 0);
    for leg in stack.p().requests().into_iter().chain(stack.d().requests()) {
        for field in [
            "routed_dp_rank",
            "data_parallel_rank",
            "disagg_prefill_dp_rank",
            "data_parallel_rank_decode",
        ] {
            assert!(leg.body.get(field).is_none(), "{field} reached an engine");
        }
        assert_eq!(leg.header("x-data-parallel-rank"), None);
        assert_eq!(leg.header("x-override-disagg-prefill-dp-rank"), None);
    }
}

/// vLLM's push-mode NIXL pairs the decode's registration with the prefill's finished
/// request by the request id: two clients repeating one `X-Request-Id` at once must not
/// swap each other's KV. The first request's decode is slow and the second's fast, so
/// the second decode registers while the first request's KV is the one held: paired by
/// the client's id, it would take that KV.
#[tokio::test]
async fn repeated_client_request_ids_do_not_cross_push_mode_legs() {
    let stack = Stack::builder()
        .protocol(Protocol::NixlPush)
        .prefill(vec![SimConfig {
            prefill_delay_per_token: Duration::from_millis(10),
            ..impatient()
        }])
        .decode(vec![
            SimConfig {
                request_delay: Duration::from_millis(600),
                ..impatient()
            },
            SimConfig {
                request_delay: Duration::from_millis(50),
                ..impatient()
            },
        ])
        .build()
        .await;
    let (first, second) = (
        "short prompt",
        "a much longer prompt of a dozen words or so here",
    );
    let send = |prompt: &'static str, after: Duration| {
        let url = stack.url.clone();
        async move {
            // Round robin: the first request gets the slow decode, the second the fast.
            tokio::time::sleep(after).await;
            let a = post(
                &url,
                COMPLETIONS,
                completion(prompt, 4, false),
                &[("x-request-id", "same-id")],
            )
            .await;
            (prompt, a)
        }
    };
    let (a, b) = tokio::join!(
        send(first, Duration::ZERO),
        send(second, Duration::from_millis(10))
    );
    for (prompt, a) in [&a, &b] {
        assert_eq!(a.status, 200, "{prompt}: {}", a.text());
        assert_eq!(a.header("x-request-id"), Some("same-id"));
        assert_eq!(
            a.content(),
            disagg_sim::generate(prompt, 4, 0).concat(),
            "{prompt}"
        );
    }
    let decodes: u64 = stack.decode.iter().map(|d| d.stats().remote_decodes).sum();
    assert_eq!(decodes, 2);
    assert_eq!(
        stack.d().stats().requests,
        1,
        "the slow decode took the first"
    );
}

/// vLLM refuses `logprob_token_ids` without `logprobs`: the prefill leg, which loses
/// `logprobs`, must lose `logprob_token_ids` too.
#[tokio::test]
async fn logprob_token_ids_with_logprobs_are_served() {
    for protocol in [Protocol::Nixl, Protocol::Mooncake] {
        let stack = Stack::builder()
            .protocol(protocol)
            .prefill(vec![impatient()])
            .decode(vec![impatient()])
            .build()
            .await;
        let a = post(
            &stack.url,
            CHAT,
            chat_with(
                "token logprobs",
                r#""logprobs":true,"logprob_token_ids":[5,6]"#,
            ),
            &[],
        )
        .await;
        assert_eq!(a.status, 200, "{protocol:?}: {}", a.text());
        let leg = &stack.p().requests()[0].body;
        assert!(
            leg.get("logprob_token_ids").is_none(),
            "{protocol:?}: {leg}"
        );
        assert!(leg.get("logprobs").is_none());
        let decode = &stack.d().requests()[0].body;
        assert_eq!(decode["logprob_token_ids"], serde_json::json!([5, 6]));
    }
}

/// For each field the rewriter changes, values vLLM accepts are served (both engines
/// contacted), and values vLLM refuses are refused by the proxy with 400 and OpenAI's
/// `param`, before any engine is contacted: the prefill engine never sees them, so it
/// cannot refuse them itself.
#[tokio::test]
async fn rewritten_fields_valid_values_are_served_and_invalid_ones_reach_no_engine() {
    struct Row {
        path: &'static str,
        extra: &'static str,
        refused: Option<&'static str>,
    }
    let ok = |path, extra| Row {
        path,
        extra,
        refused: None,
    };
    let bad = |path, extra, param| Row {
        path,
        extra,
        refused: Some(param),
    };
    let rows = [
        ok(CHAT, r#""max_tokens":3"#),
        ok(CHAT, r#""max_tokens":"3""#),
        bad(CHAT, r#""max_tokens":-1"#, "max_tokens"),
        bad(CHAT, r#""max_tokens":0"#, "max_tokens"),
        bad(CHAT, r#""max_tokens":"abc""#, "max_tokens"),
        bad(CHAT, r#""max_tokens":1.5"#, "max_tokens"),
        ok(CHAT, r#""max_completion_tokens":3"#),
        bad(
            CHAT,
            r#""max_completion_tokens":0"#,
            "max_completion_tokens",
        ),
        bad(
            CHAT,
            r#""max_completion_tokens":-5"#,
            "max_completion_tokens",
        ),
        ok(CHAT, r#""n":2,"temperature":0.8"#),
        ok(CHAT, r#""n":"2","temperature":0.8"#),
        bad(CHAT, r#""n":0"#, "n"),
        bad(CHAT, r#""n":-1"#, "n"),
        bad(CHAT, r#""n":2,"temperature":0"#, "n"),
        ok(CHAT, r#""stop":["zzz"]"#),
        bad(CHAT, r#""stop":5"#, "stop"),
        bad(CHAT, r#""stop":[""]"#, "stop"),
        ok(CHAT, r#""stop_token_ids":[7]"#),
        bad(CHAT, r#""stop_token_ids":["a"]"#, "stop_token_ids"),
        ok(CHAT, r#""min_tokens":2"#),
        bad(CHAT, r#""min_tokens":-1"#, "min_tokens"),
        bad(CHAT, r#""min_tokens":9"#, "min_tokens"),
        ok(CHAT, r#""logprobs":true,"top_logprobs":2"#),
        bad(CHAT, r#""top_logprobs":-2,"logprobs":true"#, "top_logprobs"),
        bad(CHAT, r#""top_logprobs":2"#, "top_logprobs"),
        bad(CHAT, r#""logprobs":true,"top_logprobs":21"#, "logprobs"),
        ok(
            CHAT,
            r#""stream":true,"stream_options":{"include_usage":true}"#,
        ),
        bad(
            CHAT,
            r#""stream_options":{"include_usage":true}"#,
            "stream_options",
        ),
        ok(CHAT, r#""prompt_logprobs":1"#),
        bad(
            CHAT,
            r#""prompt_logprobs":1,"stream":true"#,
            "prompt_logprobs",
        ),
        ok(CHAT, r#""ignore_eos":"yes""#),
        bad(CHAT, r#""ignore_eos":"maybe""#, "ignore_eos"),
        // A client's own handoff is never sent on, but vLLM types it as an object.
        ok(CHAT, r#""kv_transfer_params":{"remote_host":"elsewhere"}"#),
        bad(CHAT, r#""kv_transfer_params":"x""#, "kv_transfer_params"),
        ok(COMPLETIONS, r#""logprobs":2"#),
        bad(COMPLETIONS, r#""logprobs":-5"#, "logprobs"),
    ];
    let stack = Stack::builder()
        .prefill(vec![impatient()])
        .decode(vec![impatient()])
        .build()
        .await;
    let contacted = || stack.p().stats().requests + stack.d().stats().requests;
    for row in rows {
        let body = match row.path {
            CHAT => chat_with("table", row.extra),
            _ => format!(
                r#"{{"model":"sim-model","prompt":"table","max_tokens":4,{}}}"#,
                row.extra
            ),
        };
        let before = contacted();
        let a = post(&stack.url, row.path, body.clone(), &[]).await;
        match row.refused {
            None => {
                assert_eq!(a.status, 200, "{body}: {}", a.text());
                assert_eq!(a.header("x-disagg-handoff"), Some("kv"), "{body}");
                assert_eq!(contacted(), before + 2, "{body}: both legs sent");
            }
            Some(param) => {
                assert_openai_error(&a, 400, "invalid_parameter");
                assert_eq!(a.json()["error"]["param"], param, "{body}");
                assert_eq!(contacted(), before, "{body} reached an engine");
            }
        }
    }
}

/// `"stream": "yes"` is a stream to vLLM and SGLang (pydantic's lax booleans), so the
/// proxy serves it as one.
#[tokio::test]
async fn lax_boolean_stream_is_served_as_a_stream() {
    let stack = Stack::start().await;
    let a = post(&stack.url, CHAT, chat_with("lax", r#""stream":"yes""#), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(
        a.header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream"))
    );
    assert_eq!(a.events().last().map(String::as_str), Some("[DONE]"));
}

/// Beam search carries no `kv_transfer_params` in vLLM: such a request goes to a decode
/// engine alone, marked and counted, and no prefill runs for nothing.
#[tokio::test]
async fn beam_search_is_served_direct_and_counted() {
    let stack = Stack::start().await;
    let a = post(
        &stack.url,
        CHAT,
        chat_with("beams", r#""use_beam_search":true,"n":2"#),
        &[],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("direct"));
    assert_eq!(stack.p().stats().requests, 0, "a prefill ran for nothing");
    assert_eq!(stack.d().stats().beam_search_requests, 1);
    assert_eq!(stack.d().stats().local_prefills, 1);
    let metrics = get(&stack.url, "/metrics").await.text();
    assert!(
        metrics.contains("disagg_direct_total{reason=\"beam_search\"} 1"),
        "{metrics}"
    );
}

/// A prefill whose token is discarded (NIXL, Mooncake) compiles no grammar; the decode
/// that answers does.
#[tokio::test]
async fn grammars_are_compiled_only_where_the_token_is_kept() {
    let extra = r#""response_format":{"type":"json_object"}"#;
    for protocol in [Protocol::Nixl, Protocol::Mooncake] {
        let stack = Stack::builder()
            .protocol(protocol)
            .prefill(vec![impatient()])
            .decode(vec![impatient()])
            .build()
            .await;
        let a = post(&stack.url, CHAT, chat_with("grammar", extra), &[]).await;
        assert_eq!(a.status, 200, "{protocol:?}: {}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
        assert_eq!(
            stack.p().stats().grammars_compiled,
            0,
            "{protocol:?} prefill"
        );
        assert_eq!(
            stack.d().stats().grammars_compiled,
            1,
            "{protocol:?} decode"
        );
    }
}

/// LMCache's first token comes from the prefill and its decode continues from the prompt
/// plus that token; vLLM feeds only generated tokens to a grammar, so the decode's would
/// start over. A grammar-constrained request therefore goes to a decode alone, grammar
/// intact (the chat-to-completions conversion used to drop `response_format` on both
/// legs).
#[tokio::test]
async fn lmcache_serves_grammar_requests_on_a_decode_alone() {
    let stack = Stack::builder()
        .protocol(Protocol::Lmcache)
        .prefill(vec![impatient()])
        .decode(vec![impatient()])
        .build()
        .await;
    let a = post(
        &stack.url,
        CHAT,
        chat_with("grammar", r#""response_format":{"type":"json_object"}"#),
        &[],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("direct"));
    assert_eq!(stack.p().stats().requests, 0);
    assert_eq!(
        stack.d().stats().grammars_compiled,
        1,
        "the grammar reached the decode"
    );
    // A request without a grammar is still disaggregated.
    let a = post(&stack.url, CHAT, chat("no grammar", 4, false), &[]).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
}

/// A decode that refuses its leg after the prefill ran (here: its context is shorter
/// than the prefill's) takes no KV; with the early release on, the prefill's blocks are
/// released at once instead of waiting out the lease.
#[tokio::test]
async fn a_decode_that_refuses_its_leg_releases_the_prefills_kv() {
    let stack = Stack::builder()
        .prefill(vec![SimConfig {
            kv_lease: Duration::from_secs(30),
            ..SimConfig::default()
        }])
        .decode(vec![SimConfig {
            max_model_len: 48,
            ..SimConfig::default()
        }])
        .config(|c| c.kv_release = KvRelease::abort_decode())
        .build()
        .await;
    let prompt = "word ".repeat(40);
    let a = post(
        &stack.url,
        COMPLETIONS,
        completion(prompt.trim(), 30, false),
        &[],
    )
    .await;
    assert_eq!(a.status, 400, "{}", a.text());
    assert_eq!(a.header("x-disagg-failed-leg"), Some("decode"));
    assert!(
        stack.p().stats().kv_params_returned == 1,
        "the prefill ran and held KV"
    );
    let freed = eventually(Duration::from_secs(5), || {
        stack.p().stats().blocks_held == 0
    })
    .await;
    assert!(freed, "the prefill's KV was left to its 30 s lease");
    assert_eq!(stack.orchestrator.stats().kv_releases, 1);
}
