//! The `kv_events` policy end to end: the real `disagg-proxy serve` binary in front of
//! simulated engines with real prefix caches that publish vLLM-encoded KV events over
//! ZMQ (with replay sockets), all on 127.0.0.1 with ephemeral ports.
//!
//! What each engine holds is made by sending it prompts directly (not through the
//! proxy), so only the engines' own events can tell a proxy where a prefix is. Each
//! step first waits until the proxy has applied every batch the engines published
//! (`disagg_kv_events_batches_total` against the engines' own counts) and, where a
//! proxy routed the same prompt before, until its provisional entry (5 s) expired, so
//! that the events alone decide.

#![allow(missing_docs)] // a test binary

use std::path::PathBuf;
use std::time::{Duration, Instant};

use disagg_sim::{KvEventsConfig, SimConfig, SimEngine};

mod common;
use common::{Proxy, completion, post};

const COMPLETIONS: &str = "/v1/completions";
/// The scorer's provisional entries last this long (`DEFAULT_PROVISIONAL_TTL`), and a
/// little more.
const PROVISIONAL: Duration = Duration::from_millis(5300);

/// An engine with a prefix cache publishing KV events, with a replay socket.
async fn engine() -> SimEngine {
    SimEngine::start(SimConfig {
        prefix_cache_blocks: 4096,
        kv_events: Some(KvEventsConfig {
            replay_port: Some(0),
            ..KvEventsConfig::default()
        }),
        ..SimConfig::default()
    })
    .await
    .expect("start a simulated engine")
}

/// `--kv-events-endpoint` for `e`.
fn events_flag(e: &SimEngine) -> [String; 2] {
    let mut spec = format!("{}={}", e.url(), e.kv_events_endpoint().unwrap());
    if let Some(r) = e.kv_events_replay_endpoint() {
        spec.push_str(&format!(",replay={r}"));
    }
    ["--kv-events-endpoint".to_owned(), spec]
}

/// A prompt of `words` distinct words (`tag` keeps prompts of different tests apart).
fn words(tag: &str, from: usize, words: usize) -> String {
    (from..from + words)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Sends `prompt` straight to `e` (one token out): it computes and caches it, and
/// publishes the blocks it stored.
async fn warm(e: &SimEngine, prompt: &str) {
    let a = post(&e.url(), COMPLETIONS, &completion(prompt, 1, false)).await;
    assert_eq!(a.status, 200, "{}", a.text());
}

/// Waits until every proxy has connected to every engine and applied every batch the
/// engines published. A `PUB` socket drops what it sends before a subscription
/// reached it, so each engine is given a fresh one-block prompt until its next batch
/// gets through (the replay socket then brings back what came before).
async fn synced(proxies: &[&Proxy], engines: &[&SimEngine]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut poke = 0;
    loop {
        let published: u64 = engines.iter().map(|e| e.stats().kv_event_batches).sum();
        let mut all = published > 0;
        for p in proxies {
            let applied = p.metric("disagg_kv_events_batches_total").await;
            let connected = p.metric("disagg_kv_events_ranks_connected").await;
            all &= applied >= published && connected == engines.len() as u64;
        }
        if all {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the proxies did not catch up with the engines' events: {}",
            proxies[0].log()
        );
        // Give the subscriptions time before publishing more.
        tokio::time::sleep(Duration::from_millis(200)).await;
        for e in engines {
            poke += 1;
            warm(e, &words("poke", poke * 100, 16)).await;
        }
    }
}

/// Sends `prompt` through `proxy`; which of `prefills` got its prefill leg.
async fn routed(proxy: &Proxy, prefills: &[&SimEngine], prompt: &str) -> usize {
    let before: Vec<u64> = prefills
        .iter()
        .map(|e| e.stats().prefill_requests)
        .collect();
    let a = post(&proxy.url(), COMPLETIONS, &completion(prompt, 2, false)).await;
    assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    let got: Vec<usize> = prefills
        .iter()
        .zip(before)
        .enumerate()
        .filter(|(_, (e, b))| e.stats().prefill_requests > *b)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(got.len(), 1, "one prefill leg, got {got:?}");
    got[0]
}

/// A Hugging Face `tokenizer.json` (a word-level model split on whitespace) whose ids
/// are the simulator's, for every word in `texts`; in a fresh directory.
fn tokenizer_dir(texts: &[&str]) -> PathBuf {
    let mut vocab = serde_json::Map::new();
    vocab.insert("<unk>".into(), 0.into());
    for text in texts {
        for word in text.split_whitespace() {
            vocab.insert(word.into(), disagg_sim::tokenize(word)[0].into());
        }
    }
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    // One directory per call: tests of this process run at once, each with its own
    // vocabulary.
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "disagg-kv-events-tokenizer-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    dir
}

fn proxy_args(prefills: &[&SimEngine], decode: &SimEngine, extra: &[&str]) -> Vec<String> {
    let mut args = Vec::new();
    for p in prefills {
        args.extend(["--prefill".to_owned(), p.url()]);
        args.extend(events_flag(p));
    }
    args.extend(["--decode".to_owned(), decode.url()]);
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args
}

/// Blocks stored on B send the prompt to B; once B drops them and C stores them, to C.
/// Two proxies route alike: one tokenizes through the engines' `/tokenize`, the other
/// with a tokenizer file, and neither routed the prompt before the engines held it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_events_route_a_prompt_and_replicas_agree() {
    let (a, b, c, d) = (
        engine().await,
        engine().await,
        engine().await,
        engine().await,
    );
    let prefills = [&a, &b, &c];
    // 6 blocks of 16 tokens and one more: every block can hit.
    let prompt = words("kvroute", 0, 97);
    let dir = tokenizer_dir(&[&prompt]);
    let tokenizer = dir.display().to_string();
    let by_engine = Proxy::start_args(&proxy_args(
        &prefills,
        &d,
        &["--prefill-policy", "kv_events", "--tokenize", "engine"],
    ))
    .await;
    let by_file = Proxy::start_args(&proxy_args(
        &prefills,
        &d,
        &["--prefill-policy", "kv_events", "--tokenizer", &tokenizer],
    ))
    .await;
    let proxies = [&by_engine, &by_file];
    synced(&proxies, &prefills).await;

    // B computed the prompt: both proxies send it to B (second in order, so no tie
    // and no fallback picks it).
    warm(&b, &prompt).await;
    synced(&proxies, &prefills).await;
    for p in proxies {
        assert_eq!(routed(p, &prefills, &prompt).await, 1, "{}", p.log());
    }
    let routed_at = Instant::now();

    // B drops its cache (AllBlocksCleared), C computes the prompt: both send it to C.
    // Were the removal ignored, B would win the tie with C (earlier in order); were
    // C's blocks not seen, nobody would hold it and A (first) would.
    b.reset_prefix_cache();
    warm(&c, &prompt).await;
    synced(&proxies, &prefills).await;
    tokio::time::sleep(PROVISIONAL.saturating_sub(routed_at.elapsed())).await;
    for p in proxies {
        assert_eq!(routed(p, &prefills, &prompt).await, 2, "{}", p.log());
        assert!(p.metric("disagg_tokenized_total").await >= 2);
        assert_eq!(p.metric("disagg_tokenize_failures_total").await, 0);
    }
    // The engine tokenizer asked the engines; the file tokenizer did not.
    let asked: u64 = [&a, &b, &c, &d]
        .iter()
        .map(|e| e.stats().tokenize_requests)
        .sum();
    assert!(asked >= 2, "{asked}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A follow-up turn whose earlier turn sits in the decode engine's cache (it received
/// its KV) is served by that decode alone; the same length of new text is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_turn_cached_on_the_decode_skips_the_prefill() {
    let (p, d1, d2) = (engine().await, engine().await, engine().await);
    let mut args = vec![
        "--prefill".to_owned(),
        p.url(),
        "--decode".to_owned(),
        d1.url(),
        "--decode".to_owned(),
        d2.url(),
    ];
    for e in [&p, &d1, &d2] {
        args.extend(events_flag(e));
    }
    args.extend(
        [
            "--decode-policy",
            "kv_events",
            "--tokenize",
            "engine",
            "--min-prefill-tokens",
            "64",
        ]
        .map(str::to_owned),
    );
    let proxy = Proxy::start_args(&args).await;
    let engines = [&p, &d1, &d2];
    synced(&[&proxy], &engines).await;

    let turn1 = words("turn", 0, 160);
    let a = post(&proxy.url(), COMPLETIONS, &completion(&turn1, 2, false)).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
    let first_turn_at = Instant::now();
    let decode = if d1.stats().remote_decodes == 1 {
        &d1
    } else {
        &d2
    };
    assert_eq!(decode.stats().remote_decodes, 1);
    synced(&[&proxy], &engines).await;
    // Only the decode's own events say it holds the first turn from here on.
    tokio::time::sleep(PROVISIONAL.saturating_sub(first_turn_at.elapsed())).await;

    // 160 tokens cached on the decode, 40 new: below 64, served there alone.
    let turn2 = format!("{turn1} {}", words("more", 0, 40));
    let local = decode.stats().local_prefills;
    let a = post(&proxy.url(), COMPLETIONS, &completion(&turn2, 2, false)).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(
        a.header("x-disagg-handoff"),
        Some("direct"),
        "{}",
        proxy.log()
    );
    assert_eq!(decode.stats().local_prefills, local + 1);
    let cached = a.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, 160);

    // A new conversation as long as the second turn: nothing cached, disaggregated.
    let fresh = words("fresh", 0, 200);
    let a = post(&proxy.url(), COMPLETIONS, &completion(&fresh, 2, false)).await;
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
}

/// With the engines' load reports (`load=` in `--kv-events-endpoint`), the proxy sees
/// the work other routers sent: a prompt no engine holds goes to the idle engine, not
/// to the first in order, which is busy with requests the proxy never saw (without
/// the reports both look idle, and the tie goes to the first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_load_reports_steer_around_work_other_routers_sent() {
    let reporting = || {
        SimEngine::start(SimConfig {
            prefix_cache_blocks: 4096,
            kv_events: Some(KvEventsConfig {
                load_port: Some(0),
                ..KvEventsConfig::default()
            }),
            serial_prefill: true,
            prefill_delay_per_token: Duration::from_millis(4),
            ..SimConfig::default()
        })
    };
    let (busy, idle) = (reporting().await.unwrap(), reporting().await.unwrap());
    let d = engine().await;
    let mut args = Vec::new();
    for e in [&busy, &idle] {
        let [flag, spec] = events_flag(e);
        args.extend(["--prefill".to_owned(), e.url()]);
        args.extend([flag, format!("{spec},load={}", e.load_endpoint().unwrap())]);
    }
    args.extend(["--decode".to_owned(), d.url()]);
    args.extend(["--prefill-policy", "kv_events", "--tokenize", "engine"].map(String::from));
    let proxy = Proxy::start_args(&args).await;
    synced(&[&proxy], &[&busy, &idle]).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while proxy.metric("disagg_kv_events_load_reports_total").await < 2 {
        assert!(Instant::now() < deadline, "no load report: {}", proxy.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Three prompts of 200 words straight to `busy`: 800 ms of prefill each, one
    // computing and two waiting.
    let url = busy.url();
    let others: Vec<_> = (0..3)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let prompt = words(&format!("other{i}x"), 0, 200);
                post(&url, COMPLETIONS, &completion(&prompt, 1, false))
                    .await
                    .status
            })
        })
        .collect();
    // The reports go out as the queue changes; give them a moment to arrive.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let prompt = words("fresh", 0, 40);
    assert_eq!(
        routed(&proxy, &[&busy, &idle], &prompt).await,
        1,
        "{}",
        proxy.log()
    );
    for o in others {
        assert_eq!(o.await.unwrap(), 200);
    }
}
