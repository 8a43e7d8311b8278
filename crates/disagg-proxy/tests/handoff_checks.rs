//! Engine answers and handoffs checked before they are used, with the real
//! `disagg-proxy serve` binary in front of simulated engines over loopback: a prefill's
//! partial vLLM NIXL handoff never reaches the decode (which it would kill or hang, as
//! vLLM 0.33's does), SGLang rooms for every batch × `n` expansion, engine indexes
//! checked against the request, reshaped SSE events under a size cap, and an engine
//! whose `/tokenize` hangs ejected like any failing leg.

#![allow(missing_docs)] // a test binary

use disagg_sim::{Faults, PartialKv, SimConfig, SimEngine};
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

/// Every partial shape, streamed and not, through a proxy with `missing_kv` (`None`:
/// the default): the decode never gets a partial dict, and the outcome is `expect`'s.
async fn partial_handoffs(missing_kv: Option<&str>, expect: impl Fn(&common::Answer, bool)) {
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
        for stream in [false, true] {
            let a = post(&proxy.url(), COMPLETIONS, &completion(&prompt(), 4, stream)).await;
            expect(&a, stream);
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
    partial_handoffs(None, |a, stream| {
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(a.header("x-disagg-handoff"), Some("none"));
        assert_eq!(a.content(), expected, "stream: {stream}");
    })
    .await;
}

#[tokio::test]
async fn a_partial_handoff_fails_the_request_under_missing_kv_fail() {
    partial_handoffs(Some("fail"), |a, _| {
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
