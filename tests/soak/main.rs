//! Soak: 20,000 requests through the proxy with random faults and cancellations, in
//! one bounded run (about 20 s in a debug build on 2 cores); more, 5,000 at a time up
//! to 50,000, while fewer than 1,000 of them met no fault (a loaded machine fits fewer
//! requests in the calm spells between faults).
//!
//! Asserts that every answer is either right or a defined failure: a 2xx answer carries
//! exactly the text the simulated model gives for its prompt (predicted with
//! `disagg_sim::generate`), and a stream ends with `[DONE]`; a failure is one of the
//! outcomes the injected faults define (see `DEFINED_FAILURES`); and every request that no
//! fault could have touched (no fault was on from its start to its end) succeeds, but for
//! a few (at most 1 in 50) that ran out of a budget after it had passed (`BUDGET_FAILURES`):
//! engines, proxy and 48 clients share two cores here, so a clean request's prefill or
//! chunk gap now and then takes longer than the 250 ms budgets. And, once the run is over:
//! - resident memory is back within 24 MiB of its level after a warm-up of the same mix
//!   (engines, proxy and load generator all live in this process, so this bounds leaks
//!   in all three);
//! - the prefill engines hold no KV blocks and no pending transfers (early KV release
//!   on), and no engine has a request left running;
//! - the proxy has nothing in flight: endpoint counts, admitted requests, running
//!   releases.
//!
//! The faults, switched at random every few milliseconds (with a calm spell now and then:
//! 200 ms, or until 48 requests met no fault, up to 3 s) on one prefill and one decode engine: a prefill answering 503 (retried elsewhere) or 500, a prefill that hangs past
//! its 250 ms budget, a decode stream that stalls past the 250 ms idle budget or whose connection
//! drops. Decode faults are those that strike after the decode took the KV; a decode
//! that refuses a request without taking the KV leaves it to the prefill's lease (see
//! docs/reliability.md), which a zero-stranded assertion cannot allow. Cancellations:
//! one request in five is abandoned by its client after 0-8 ms, at whatever stage it is.

#[path = "../support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use disagg_core::orchestrator::KvRelease;
use disagg_resilience::RetryPolicy;
use disagg_sim::{Faults, SimConfig};
use http_body_util::{BodyExt, Full};
use support::*;

const TOTAL: u64 = 20_000;
/// Requests sent at most, while fewer than [`MIN_CLEAN`] met no fault.
const MAX_TOTAL: u64 = 50_000;
/// Requests that met no fault needed to tell that such requests succeed.
const MIN_CLEAN: u64 = 1_000;
const WARM_UP: u64 = 5_000;
const CLIENTS: u64 = 48;
const RSS_MARGIN: u64 = 24 * 1024 * 1024;

/// Resident memory of this process, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// A small deterministic generator per client (xorshift64*).
struct Rand(u64);

impl Rand {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// How a request may fail when it met an injected fault, as "STATUS CODE" (the proxy's
/// OpenAI error code, or the code of a stream's final error event), or how its body broke.
/// Anything else (a wrong text, a stream without `[DONE]` and without an error event, a
/// 2xx whose body is not an answer) is a bug.
const DEFINED_FAILURES: &[&str] = &[
    // A prefill answering 500, or 503 with no retry left (budget, or the retry met the
    // fault again).
    "502 prefill_failed",
    // A prefill hanging past its budget.
    "504 prefill_timeout",
    // A decode stream that stalls, or whose connection drops, after its head.
    "200 decode_idle_timeout",
    "200 decode_stream_failed",
    // The same faults on a non-streamed answer: its body breaks.
    "body broke (not streamed)",
];

/// The prefill and decode idle budgets of the run (short, so the faults that hang or
/// stall end fast).
const BUDGET: Duration = Duration::from_millis(250);

/// The failures a budget makes: a prefill head, or a gap between a stream's chunks
/// (a non-streamed answer's body breaks instead), that took longer than [`BUDGET`].
/// A request no fault touched may meet them only after [`BUDGET`] passed, and rarely:
/// at most one in [`SLOW_CLEAN_PER`].
const BUDGET_FAILURES: &[&str] = &[
    "504 prefill_timeout",
    "200 decode_idle_timeout",
    "body broke (not streamed)",
];

/// At most one clean request in this many may fail by a budget (a slow, not a wrong,
/// answer). One pause of the whole process longer than a budget fails up to one
/// request per client at once (20 clean requests in a row did, on a machine loaded
/// with two CPU hogs besides this test); a leg that hung on a clean engine would fail
/// many more.
const SLOW_CLEAN_PER: u64 = 50;

/// Which faults are on: the chaos task turns them on and off, and a request checks it
/// at its start and end to know whether a fault could have touched it.
#[derive(Default)]
struct FaultClock {
    /// Some fault is set on an engine now.
    on: std::sync::atomic::AtomicBool,
    /// Times a fault was turned on.
    switched_on: AtomicU64,
}

impl FaultClock {
    /// Before setting `faulty` faults on the engines (or after clearing them).
    fn before_set(&self, faulty: bool) {
        if faulty {
            self.on.store(true, Ordering::SeqCst);
            self.switched_on.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// After setting the engines' faults.
    fn after_set(&self, faulty: bool) {
        if !faulty {
            self.on.store(false, Ordering::SeqCst);
        }
    }

    /// A mark taken when a request starts: `None` if a fault is on.
    fn start(&self) -> Option<u64> {
        let generation = self.switched_on.load(Ordering::SeqCst);
        (!self.on.load(Ordering::SeqCst)).then_some(generation)
    }

    /// Whether no fault was on at any time since `mark`: engines apply the faults of
    /// the moment a leg arrives, so such a request met none.
    fn clean_since(&self, mark: Option<u64>) -> bool {
        mark.is_some_and(|g| g == self.switched_on.load(Ordering::SeqCst))
    }
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    errors: AtomicU64,
    cancelled: AtomicU64,
    /// Requests no fault could have touched, and how many of them failed.
    clean: AtomicU64,
    clean_failed: std::sync::Mutex<Vec<String>>,
    /// Clean requests a budget failed after the budget passed (see [`BUDGET_FAILURES`]).
    clean_slow: std::sync::Mutex<Vec<String>>,
    /// Failed requests by status and OpenAI error code (or how the body broke).
    codes: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

impl Tally {
    fn failed(&self, what: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        *self.codes.lock().unwrap().entry(what).or_default() += 1;
    }
}

/// The status and error code of a failed answer.
fn failure(status: http::StatusCode, body: &[u8]) -> String {
    let code = body
        .windows(8)
        .position(|w| w == b"\"code\":\"")
        .and_then(|i| {
            let rest = &body[i + 8..];
            let end = rest.iter().position(|&b| b == b'"')?;
            Some(String::from_utf8_lossy(&rest[..end]).into_owned())
        })
        .unwrap_or_default();
    format!("{} {code}", status.as_u16())
}

/// The generated text of a 2xx answer, if it is a complete answer: a stream must end
/// with `[DONE]`. `Err` names what the body is instead: the code of a stream's final
/// error event, or that it is no answer.
fn answer_text(chat: bool, stream: bool, body: &[u8]) -> Result<String, String> {
    let text_of = |v: &serde_json::Value| -> Option<String> {
        let c = &v["choices"][0];
        let t = if !chat {
            &c["text"]
        } else if stream {
            &c["delta"]["content"]
        } else {
            &c["message"]["content"]
        };
        t.as_str().map(str::to_owned)
    };
    if !stream {
        let v: serde_json::Value =
            serde_json::from_slice(body).map_err(|_| "2xx: not JSON".to_owned())?;
        if let Some(code) = v["error"]["code"].as_str() {
            return Err(format!("200 {code}"));
        }
        return text_of(&v).ok_or_else(|| "2xx: no text".to_owned());
    }
    let events = sse_payloads(body);
    let mut out = String::new();
    for (i, e) in events.iter().enumerate() {
        if e == "[DONE]" {
            return if i + 1 == events.len() {
                Ok(out)
            } else {
                Err("2xx: events after [DONE]".to_owned())
            };
        }
        let v: serde_json::Value =
            serde_json::from_str(e).map_err(|_| "2xx: an event is not JSON".to_owned())?;
        if let Some(code) = v["error"]["code"].as_str() {
            return Err(format!("200 {code}"));
        }
        // A chat stream's first chunk names the role; its content is empty.
        out.push_str(&text_of(&v).unwrap_or_default());
    }
    Err("2xx: stream without [DONE] or error event".to_owned())
}

/// Send requests numbered `from..to` (shared counter) with random shapes and
/// cancellations, `CLIENTS` at a time.
async fn drive(
    url: &str,
    next: &Arc<AtomicU64>,
    to: u64,
    tally: &Arc<Tally>,
    faults: &Arc<FaultClock>,
) {
    let client = client();
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let (client, url, next, tally, faults) = (
            client.clone(),
            url.to_owned(),
            Arc::clone(next),
            Arc::clone(tally),
            Arc::clone(faults),
        );
        tasks.push(tokio::spawn(async move {
            let mut rand = Rand(0x9e37_79b9_7f4a_7c15 ^ ((c + 1) * 0x1234_5678));
            while let Ok(n) = next.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < to).then_some(n + 1)
            }) {
                let stream = rand.below(2) == 0;
                let tokens = 1 + rand.below(6) as u32;
                let is_chat = rand.below(2) == 0;
                // The chat template is the message's text and a newline, which tokenizes
                // like the text alone: both forms have the same answer.
                let expected =
                    disagg_sim::generate(&format!("soak {n}"), tokens as usize, 0).concat();
                let (path, body) = if is_chat {
                    (
                        "/v1/chat/completions",
                        chat(&format!("soak {n}"), tokens, stream),
                    )
                } else {
                    (
                        "/v1/completions",
                        completion(&format!("soak {n}"), tokens, stream),
                    )
                };
                let body_shape = format!("n={n} tokens={tokens} stream={stream}");
                let req = http::Request::post(format!("{url}{path}"))
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .unwrap();
                let exchange = async {
                    let resp = client
                        .request(req)
                        .await
                        .map_err(|_| "request failed".to_owned())?;
                    let status = resp.status();
                    let body = resp
                        .into_body()
                        .collect()
                        .await
                        .map_err(|_| {
                            if stream {
                                "body broke (streamed)".to_owned()
                            } else {
                                "body broke (not streamed)".to_owned()
                            }
                        })?
                        .to_bytes();
                    if !status.is_success() {
                        return Err(failure(status, &body));
                    }
                    let text = answer_text(is_chat, stream, &body)?;
                    if text == expected {
                        Ok(())
                    } else {
                        Err(format!("2xx: wrong text {text:?}, expected {expected:?}"))
                    }
                };
                let limit = if rand.below(5) == 0 {
                    Duration::from_millis(rand.below(9))
                } else {
                    Duration::from_secs(10)
                };
                let mark = faults.start();
                let started = Instant::now();
                let result = tokio::time::timeout(limit, exchange).await;
                let took = started.elapsed();
                let clean = faults.clean_since(mark);
                if clean && result.is_ok() {
                    tally.clean.fetch_add(1, Ordering::Relaxed);
                }
                match result {
                    Ok(Ok(())) => {
                        tally.ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Err(what)) => {
                        if clean {
                            let slow = BUDGET_FAILURES.contains(&what.as_str()) && took >= BUDGET;
                            let list = if slow {
                                &tally.clean_slow
                            } else {
                                &tally.clean_failed
                            };
                            list.lock()
                                .unwrap()
                                .push(format!("{path} {body_shape} in {took:?}: {what}"));
                        }
                        tally.failed(what);
                    }
                    Err(_) => {
                        tally.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_requests_with_faults_and_cancellations_leave_nothing_behind() {
    let fast = || SimConfig {
        record_requests: 0,
        bootstrap_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let s = Stack::builder()
        .prefill(vec![fast(), fast(), fast()])
        .decode(vec![fast(), fast()])
        .config(|c| {
            c.prefill_timeout = BUDGET;
            c.decode_idle_timeout = Some(BUDGET);
            c.decode_head_timeout = Duration::from_secs(5);
            // A generous grace: under load a prefill's answer may take a while to be read.
            c.kv_release = KvRelease::AbortDecode {
                grace: Duration::from_secs(1),
                wait: Duration::from_secs(2),
            };
        })
        .retry(RetryPolicy::retries(1))
        .build()
        .await;

    // Faults switched at random on prefill 2 and decode 1 until the run ends.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let faults = Arc::new(FaultClock::default());
    let tally = Arc::new(Tally::default());
    let chaos = async {
        let (p, d) = (&s.prefill[2], &s.decode[1]);
        let mut rand = Rand(42);
        while !stop.load(Ordering::Relaxed) {
            let pf = match rand.below(8) {
                0 => Faults {
                    status: Some(503),
                    ..Faults::default()
                },
                1 => Faults {
                    status: Some(500),
                    ..Faults::default()
                },
                2 => Faults {
                    hang: true,
                    ..Faults::default()
                },
                _ => Faults::default(),
            };
            let df = match rand.below(6) {
                0 => Faults {
                    stall_after_chunks: Some(1),
                    ..Faults::default()
                },
                1 => Faults {
                    drop_after_chunks: Some(1),
                    ..Faults::default()
                },
                _ => Faults::default(),
            };
            let faulty = pf != Faults::default() || df != Faults::default();
            faults.before_set(faulty);
            p.set_faults(pf);
            d.set_faults(df);
            faults.after_set(faulty);
            // Now and then a calm spell longer than a request takes under this load, so
            // that many requests meet no fault at all and can be held to succeed: at
            // least 200 ms, and on a machine so loaded that requests take longer, until
            // as many requests as there are clients met no fault (3 s at most).
            if !faulty && rand.below(10) == 0 {
                let (clean, calm) = (tally.clean.load(Ordering::Relaxed), Instant::now());
                tokio::time::sleep(Duration::from_millis(200)).await;
                while tally.clean.load(Ordering::Relaxed) < clean + CLIENTS
                    && calm.elapsed() < Duration::from_secs(3)
                {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            } else {
                tokio::time::sleep(Duration::from_millis(5 + rand.below(20))).await;
            }
        }
        p.set_faults(Faults::default());
        d.set_faults(Faults::default());
    };

    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut warm_rss = 0;
    let load = async {
        drive(&s.url, &next, WARM_UP, &tally, &faults).await;
        warm_rss = rss();
        let mut total = TOTAL;
        loop {
            drive(&s.url, &next, total, &tally, &faults).await;
            if tally.clean.load(Ordering::Relaxed) >= MIN_CLEAN || total >= MAX_TOTAL {
                break;
            }
            total = (total + 5_000).min(MAX_TOTAL);
        }
        stop.store(true, Ordering::Relaxed);
        total
    };
    let ((), total) = tokio::join!(chaos, load);
    let took = start.elapsed();

    let (ok, errors, cancelled) = (
        tally.ok.load(Ordering::Relaxed),
        tally.errors.load(Ordering::Relaxed),
        tally.cancelled.load(Ordering::Relaxed),
    );
    eprintln!(
        "soak: {total} requests in {took:?}: {ok} ok, {errors} failed {:?}, {cancelled} cancelled; {:?}",
        tally.codes.lock().unwrap(),
        s.orchestrator.stats()
    );
    assert_eq!(ok + errors + cancelled, total);
    assert!(ok > total / 2, "most requests succeed despite the faults");
    // Every failure is one the faults define.
    let undefined: Vec<(String, u64)> = tally
        .codes
        .lock()
        .unwrap()
        .iter()
        .filter(|(what, _)| !DEFINED_FAILURES.contains(&what.as_str()))
        .map(|(w, n)| (w.clone(), *n))
        .collect();
    assert!(
        undefined.is_empty(),
        "failures no fault defines: {undefined:?}"
    );
    // Every request no fault could have touched succeeded, and there were many; a few
    // were only slow: a budget ran out after it had passed.
    let clean = tally.clean.load(Ordering::Relaxed);
    let clean_failed = std::mem::take(&mut *tally.clean_failed.lock().unwrap());
    let clean_slow = std::mem::take(&mut *tally.clean_slow.lock().unwrap());
    eprintln!(
        "soak: {clean} requests met no fault, {} of them slower than a budget: {:?}",
        clean_slow.len(),
        &clean_slow[..clean_slow.len().min(5)]
    );
    assert!(
        clean_failed.is_empty(),
        "{} of {clean} requests that met no fault failed: {:?}",
        clean_failed.len(),
        &clean_failed[..clean_failed.len().min(20)]
    );
    assert!(
        clean_slow.len() as u64 * SLOW_CLEAN_PER <= clean,
        "{} of {clean} requests that met no fault ran out of a budget: {:?}",
        clean_slow.len(),
        &clean_slow[..clean_slow.len().min(20)]
    );
    assert!(
        clean >= MIN_CLEAN,
        "too few requests without faults ({clean} in {total}) to tell"
    );
    assert!(
        cancelled > total / 10 && errors > 0,
        "faults and cancellations happened"
    );

    // Nothing left in flight, in the proxy or the engines.
    let settled = eventually(Duration::from_secs(10), || {
        let st = s.orchestrator.stats();
        s.in_flight() == 0
            && st.in_flight == 0
            && st.kv_releases_in_flight == 0
            && s.prefill
                .iter()
                .chain(&s.decode)
                .all(|e| e.stats().active_requests == 0)
    })
    .await;
    assert!(
        settled,
        "left over: {} in flight, {:?}, engines {:?}",
        s.in_flight(),
        s.orchestrator.stats(),
        s.prefill
            .iter()
            .chain(&s.decode)
            .map(|e| e.stats().active_requests)
            .collect::<Vec<_>>()
    );
    // No stranded KV: every block a prefill held was pulled or released.
    let stranded = || -> Vec<(u64, u64)> {
        s.prefill
            .iter()
            .map(|p| {
                let st = p.stats();
                (st.blocks_held, st.kv_transfers_pending)
            })
            .collect()
    };
    assert!(
        eventually(Duration::from_secs(5), || stranded()
            .iter()
            .all(|&(b, t)| b == 0 && t == 0))
        .await,
        "stranded KV on the prefills: {:?}",
        stranded()
    );
    let after_rss = rss();
    eprintln!("soak: RSS after warm-up {warm_rss} B, after the run {after_rss} B");
    assert!(
        after_rss <= warm_rss + RSS_MARGIN,
        "resident memory grew from {warm_rss} to {after_rss} bytes"
    );
}
