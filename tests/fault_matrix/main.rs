//! The fault matrix: each connector (vLLM NIXL, SGLang, vLLM Mooncake, LMCache) against
//! each fault an engine can show, on each leg where it applies: a refused connection, 500
//! and 503, a hang before the response head, a stall and a dropped connection mid-stream,
//! a prefill slower than its budget, a malformed handoff, a bootstrap that never meets,
//! and (LMCache) a KV-ready notification that never comes.
//!
//! Every case asserts what the client gets (the status and OpenAI error code, or the
//! in-band end of a stream that broke after its head), within a stated time, and that
//! nothing survives it: no endpoint in-flight count, no admitted request, no running
//! request on any engine, no engine that gave up waiting for a peer the proxy forgot, and
//! no KV held on a prefill (LMCache: on a decode, where its KV lives), except where the
//! protocol itself keeps it until a lease (see "KV block lifetime" in
//! crates/disagg-sim/src/lib.rs), which the case then states and checks, and (LMCache) no
//! request left in the proxy's notification registry. The outcomes are tabled in
//! docs/reliability.md (fault matrix).
//!
//! One test per connector; its cases run concurrently, each on a stack of its own
//! (ephemeral ports), so a connector's whole table takes about as long as its slowest
//! case.

#[path = "../support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use disagg_core::endpoint::Facts;
use disagg_core::{Endpoint, EndpointSource, Role};
use disagg_sim::{Faults, SimConfig};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Every per-step budget of the proxy (prefill, handoff, decode head, decode idle):
/// short, so a fault found by a budget shows fast.
const BUDGET: Duration = Duration::from_millis(500);
/// Most time a failure may take that needs no budget to run out (refused, an error
/// status, a malformed answer, a dropped connection): less than [`BUDGET`], so a leg
/// the proxy waited for instead of dropping it at once (until its budget ran out)
/// fails the case.
const FAST: Duration = Duration::from_millis(400);
/// Most time a failure may take that a budget finds.
const TIMED: Duration = Duration::from_millis(1500);
/// How long an engine waits for its peer (`SimConfig::bootstrap_timeout`): an SGLang
/// decode for its room, an SGLang prefill for a decode to take it, a Mooncake decode
/// for its transfer. Shorter than [`LINGER`], so a leg the proxy failed to drop gives
/// up within the case and is counted in `Stats::bootstrap_timeouts`.
const PEER_WAIT: Duration = Duration::from_millis(800);
/// Every engine must be idle, and every count back to zero, this soon after the answer.
const SETTLE: Duration = Duration::from_secs(1);
/// The engines' give-up counters are read this long after the answer (past
/// [`PEER_WAIT`]).
const LINGER: Duration = Duration::from_millis(1200);
/// The prefill's KV lease in cases where the protocol keeps the KV until it runs out;
/// other cases keep the default 30 s lease, so KV freed within a case was not freed by
/// the lease.
const SHORT_LEASE: Duration = Duration::from_millis(1500);
/// The sweep of a lease runs every quarter lease: freed by then, with a margin.
const LEASE_FREED: Duration = Duration::from_millis(3500);

/// What a case injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The prefill endpoint's port has nobody listening.
    PrefillRefused,
    /// The decode endpoint's port has nobody listening.
    DecodeRefused,
    /// The prefill engine answers this status.
    PrefillStatus(u16),
    /// The decode engine answers this status.
    DecodeStatus(u16),
    /// The prefill engine never sends a response head.
    PrefillHang,
    /// The decode engine never sends a response head.
    DecodeHang,
    /// The decode engine stops sending after two events (streamed) or half the body
    /// (not streamed) and keeps the connection open.
    DecodeStall,
    /// The decode engine aborts the connection after two events (or mid-body).
    DecodeDrop,
    /// The prefill engine waits 3 s before working, beyond the prefill budget.
    SlowPrefill,
    /// vLLM NIXL: the prefill answers 200 with `kv_transfer_params` a string.
    /// vLLM Mooncake: the prefill's bootstrap server answers `GET /query` with no
    /// engine id (the one handoff value a Mooncake proxy reads from an engine).
    MalformedHandoff,
    /// SGLang and Mooncake: the prefill answers 503 at once and so never registers the
    /// room or transfer the decode leg, sent alongside, waits for.
    BootstrapNeverMet,
    /// LMCache: the prefill pushes the KV but its KV-ready notification is lost.
    NotificationLost,
}

/// What the client gets.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    /// The proxy's own OpenAI error: this status and `error.code`.
    Error(u16, &'static str),
    /// The decode engine's error answer with this status, passed through as the engine
    /// wrote it, marked `x-disagg-failed-leg: decode`.
    DecodeAnswer(u16),
    /// 200, and an event stream whose last event is `{"error": {...}}` with this code,
    /// with no `[DONE]`.
    StreamError(&'static str),
    /// 200, and a body that breaks before it is complete.
    BrokenBody,
}

/// What the engine holding a request's KV for the decode holds once the case is over:
/// the prefill, or with LMCache (whose prefill pushes the KV at once) the decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kv {
    /// Nothing, within [`SETTLE`]: it was freed at once (pulled, withdrawn with its
    /// cancelled request) or never held.
    Freed,
    /// The KV the prefill handed over, until its lease runs out: nobody will take it and
    /// the protocol gives the prefill no signal. Held when the client got its answer,
    /// freed by the ([`SHORT_LEASE`]) lease.
    UntilLease,
}

/// Which engine of a stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leg {
    Prefill,
    Decode,
}

/// One row of the matrix for one connector.
#[derive(Debug)]
struct Case {
    name: &'static str,
    fault: Fault,
    stream: bool,
    outcome: Outcome,
    /// The answer (to its last byte, or its break) comes within this range.
    min: Duration,
    max: Duration,
    kv: Kv,
    /// The engines whose request the proxy must abandon: their `cancelled` count is 1.
    abandoned: Vec<Leg>,
    /// The engines whose leg went out alongside one that failed at once: the proxy must
    /// drop it, which its engine sees as a cancelled request if the leg got there
    /// before the failure got to the proxy, else not at all (the leg was sent: the
    /// engine has a connection, but no request). A leg the proxy failed to drop is
    /// still running (or gave up on its peer) when the case checks.
    dropped_alongside: Vec<Leg>,
    /// The decode engine never receives a request.
    decode_untouched: bool,
    /// The prefill engine waits this long before working (so it is still busy when an
    /// instant decode failure drops it).
    prefill_delay: Duration,
}

impl Case {
    fn new(name: &'static str, fault: Fault, outcome: Outcome) -> Self {
        Case {
            name,
            fault,
            stream: false,
            outcome,
            min: Duration::ZERO,
            max: FAST,
            kv: Kv::Freed,
            abandoned: Vec::new(),
            dropped_alongside: Vec::new(),
            decode_untouched: false,
            prefill_delay: Duration::ZERO,
        }
    }

    fn streamed(mut self) -> Self {
        self.stream = true;
        self
    }

    /// Found by a budget: no sooner than the budget, within [`TIMED`].
    fn timed(mut self) -> Self {
        self.min = BUDGET - Duration::from_millis(10);
        self.max = TIMED;
        self
    }

    fn kv(mut self, kv: Kv) -> Self {
        self.kv = kv;
        self
    }

    fn abandons(mut self, leg: Leg) -> Self {
        self.abandoned.push(leg);
        self
    }

    fn abandons_if(self, yes: bool, leg: Leg) -> Self {
        if yes { self.abandons(leg) } else { self }
    }

    /// Concurrent connectors only: the other leg, sent alongside, is abandoned too.
    fn abandons_if_concurrent(self, p: Protocol, leg: Leg) -> Self {
        self.abandons_if(concurrent(p), leg)
    }

    /// `leg` went out alongside a leg that fails at once, and is dropped (see
    /// [`Case::dropped_alongside`]).
    fn drops_alongside(mut self, leg: Leg) -> Self {
        self.dropped_alongside.push(leg);
        self
    }

    /// Concurrent connectors only: [`Case::drops_alongside`].
    fn drops_alongside_if_concurrent(self, p: Protocol, leg: Leg) -> Self {
        if concurrent(p) {
            self.drops_alongside(leg)
        } else {
            self
        }
    }

    fn decode_untouched_if(mut self, yes: bool) -> Self {
        self.decode_untouched = yes;
        self
    }

    fn prefill_delay(mut self, delay: Duration) -> Self {
        self.prefill_delay = delay;
        self
    }
}

/// Whether `p` sends both legs at once.
fn concurrent(p: Protocol) -> bool {
    matches!(p, Protocol::Sglang | Protocol::Mooncake)
}

/// The matrix for `p`. Where the connectors differ, the row says why.
fn table(p: Protocol) -> Vec<Case> {
    use Fault::*;
    use Outcome::*;
    let nixl = p == Protocol::Nixl;
    let mooncake = p == Protocol::Mooncake;
    let lmcache = p == Protocol::Lmcache;
    // vLLM NIXL and LMCache send the decode leg only after the prefill answered (LMCache:
    // and notified), so a prefill failure never reaches the decode engine. Mooncake
    // resolves the prefill's engine id on its bootstrap server before sending either leg,
    // so a prefill that cannot be reached never reaches the decode engine either. SGLang
    // sends both legs at once.
    let sequential = !concurrent(p);
    // A decode that fails before its head: a NIXL prefill has already answered and holds
    // its blocks for a decode that will never pull them, and neither a refused decode, a
    // decode answering an error status before its pull, nor a hung one tells the prefill
    // (sim docs: "Neither a decode rejected before its pull ... nor hung by
    // Faults::hang ... frees anything"). An LMCache prefill has pushed the KV to the
    // decode's receiver, where it waits for a request that takes it, or for its lease
    // (sim docs, "LMCache"). Concurrent prefills are still busy and are dropped with the
    // attempt: SGLang's rooms are withdrawn, a Mooncake prefill cancelled before its
    // answer holds nothing.
    let decode_failed_early = if nixl || lmcache {
        Kv::UntilLease
    } else {
        Kv::Freed
    };
    // A Mooncake prefill without a delay can answer (and hold its transfer) before an
    // instant decode failure drops it, a race; a scheduling delay far longer than the
    // decode failure takes to reach the proxy makes these rows deterministic. A prefill
    // leg the proxy failed to drop is still running when the case checks, within
    // [`SETTLE`], that no engine is. The `decode hang` row shows the other side of the
    // race.
    let busy = if mooncake {
        Duration::from_secs(3)
    } else {
        Duration::ZERO
    };

    let mut t = vec![
        Case::new(
            "prefill refused",
            PrefillRefused,
            Error(502, "prefill_failed"),
        )
        .decode_untouched_if(sequential || mooncake),
        Case::new("decode refused", DecodeRefused, Error(502, "decode_failed"))
            .kv(decode_failed_early)
            .prefill_delay(busy),
        Case::new(
            "prefill 500",
            PrefillStatus(500),
            Error(502, "prefill_failed"),
        )
        .decode_untouched_if(sequential),
        Case::new(
            "prefill 503",
            PrefillStatus(503),
            Error(502, "prefill_failed"),
        )
        .decode_untouched_if(sequential),
        // The decode's answer is the client's answer whatever its status: the engine's
        // own error, passed through (docs/architecture.md).
        Case::new("decode 500", DecodeStatus(500), DecodeAnswer(500))
            .kv(decode_failed_early)
            .prefill_delay(busy)
            .drops_alongside_if_concurrent(p, Leg::Prefill),
        Case::new("decode 503", DecodeStatus(503), DecodeAnswer(503))
            .kv(decode_failed_early)
            .prefill_delay(busy)
            .drops_alongside_if_concurrent(p, Leg::Prefill),
        Case::new(
            "prefill hang before head",
            PrefillHang,
            Error(504, "prefill_timeout"),
        )
        .timed()
        .abandons(Leg::Prefill)
        .abandons_if_concurrent(p, Leg::Decode)
        .decode_untouched_if(sequential),
        // A Mooncake prefill answers at once and holds its transfer for the decode; the
        // decode hangs before it pulls, and a Mooncake decode aborted before its pull
        // tells nobody (sim docs), so the transfer waits for the lease. An SGLang
        // prefill waits for the decode to take its room, is dropped with the attempt,
        // and withdraws it.
        //
        // SGLang names the wrong leg: its prefill answers only once a decode took its
        // room, so a hung decode stalls the prefill exchange too, whose budget (started
        // first, as long as the decode head's, as by default) runs out first. The client
        // gets 504 either way; the code says `prefill_timeout`.
        Case::new(
            "decode hang before head",
            DecodeHang,
            Error(
                504,
                if p == Protocol::Sglang {
                    "prefill_timeout"
                } else {
                    "decode_timeout"
                },
            ),
        )
        .timed()
        .abandons(Leg::Decode)
        .abandons_if(p == Protocol::Sglang, Leg::Prefill)
        .kv(if p == Protocol::Sglang {
            Kv::Freed
        } else {
            Kv::UntilLease
        }),
        // Mid-stream faults come after the decode pulled the KV: nothing is left.
        Case::new(
            "decode stall mid-stream",
            DecodeStall,
            StreamError("decode_idle_timeout"),
        )
        .streamed()
        .timed()
        .abandons(Leg::Decode),
        Case::new("decode stall mid-body", DecodeStall, BrokenBody)
            .timed()
            .abandons(Leg::Decode),
        Case::new(
            "decode drop mid-stream",
            DecodeDrop,
            StreamError("decode_stream_failed"),
        )
        .streamed(),
        Case::new("decode drop mid-body", DecodeDrop, BrokenBody),
        Case::new(
            "slow prefill beyond budget",
            SlowPrefill,
            Error(504, "prefill_timeout"),
        )
        .timed()
        .abandons(Leg::Prefill)
        .abandons_if_concurrent(p, Leg::Decode)
        .decode_untouched_if(sequential),
    ];
    match p {
        Protocol::Nixl => {
            // The fault answers no blocks and holds none (sim docs on
            // `Faults::malformed_kv_params`); the proxy cannot build a decode leg.
            t.push(
                Case::new(
                    "malformed kv_transfer_params",
                    MalformedHandoff,
                    Error(502, "prefill_failed"),
                )
                .decode_untouched_if(true),
            );
            // No "bootstrap never met" row: NIXL has no bootstrap, and its decode leg
            // is sent only with the prefill's answer in hand.
        }
        Protocol::Mooncake => {
            // A Mooncake prefill's answer carries no handoff (`kv_transfer_params:
            // null`); what the proxy reads from the prefill side is the bootstrap
            // server's engine id, so that is the answer to malform. `resolve` fails
            // before either leg is sent.
            t.push(
                Case::new(
                    "malformed bootstrap answer",
                    MalformedHandoff,
                    Error(502, "prefill_failed"),
                )
                .decode_untouched_if(true),
            );
        }
        Protocol::Lmcache => {
            // The prefill pushed the KV and answered, but the proxy never hears that the
            // KV arrived: the handoff budget ends the wait, no decode leg is sent, and the
            // registration is forgotten. The pushed KV waits on the decode for its lease.
            t.push(
                Case::new(
                    "notification lost",
                    NotificationLost,
                    Error(504, "handoff_timeout"),
                )
                .timed()
                .kv(Kv::UntilLease)
                .decode_untouched_if(true),
            );
            // No malformed-handoff row: LMCache's handoff is the notification (its loss
            // is the row above); a prefill answer without `first_tok` is a connector unit
            // test's matter.
        }
        // No malformed-handoff row for SGLang: the proxy chooses the room and reads
        // nothing from either engine to build the legs (the prefill's answer is only
        // checked for success), so there is nothing an engine could malform.
        _ => {}
    }
    if concurrent(p) {
        // The decode leg goes out with the prefill leg and waits for a room or transfer
        // that will never be registered; the proxy must drop it as soon as the prefill
        // failed, not leave it to the engine's bootstrap timeout.
        t.push(
            Case::new(
                "bootstrap never met",
                BootstrapNeverMet,
                Error(502, "prefill_failed"),
            )
            .drops_alongside(Leg::Decode),
        );
    }
    t
}

/// An engine of the matrix: peers give up quickly, and the lease is short where the
/// case waits for it.
fn engine(case: &Case, faults: Faults) -> SimConfig {
    let mut c = SimConfig {
        faults,
        bootstrap_timeout: PEER_WAIT,
        ..SimConfig::default()
    };
    if case.kv == Kv::UntilLease {
        c.kv_lease = SHORT_LEASE;
    }
    c
}

fn status(code: u16) -> Faults {
    Faults {
        status: Some(code),
        ..Faults::default()
    }
}

/// The stack for one case, and the socket holding a dead endpoint's port (bound, not
/// listening) so that no other case's engine takes it while the case runs.
async fn stack(p: Protocol, case: &Case) -> (Stack, Option<tokio::net::TcpSocket>) {
    let none = Faults::default();
    let (pf, df) = match case.fault {
        Fault::PrefillStatus(code) => (status(code), none),
        Fault::DecodeStatus(code) => (none, status(code)),
        Fault::BootstrapNeverMet => (status(503), none),
        Fault::PrefillHang => (Faults { hang: true, ..none }, none),
        Fault::DecodeHang => (none, Faults { hang: true, ..none }),
        Fault::DecodeStall => (
            none,
            Faults {
                stall_after_chunks: Some(2),
                ..none
            },
        ),
        Fault::DecodeDrop => (
            none,
            Faults {
                drop_after_chunks: Some(2),
                ..none
            },
        ),
        Fault::MalformedHandoff if p == Protocol::Nixl => (
            Faults {
                malformed_kv_params: true,
                ..none
            },
            none,
        ),
        Fault::NotificationLost => (
            Faults {
                notify_loss: 1.0,
                ..none
            },
            none,
        ),
        _ => (none, none),
    };
    let mut prefill = engine(case, pf);
    prefill.request_delay = match case.fault {
        Fault::SlowPrefill => Duration::from_secs(3),
        _ => case.prefill_delay,
    };
    let decode = engine(case, df);
    let builder = Stack::builder()
        .protocol(p)
        .prefill(vec![prefill])
        .decode(vec![decode])
        .config(|c| {
            c.prefill_timeout = BUDGET;
            c.handoff_timeout = BUDGET;
            c.decode_head_timeout = BUDGET;
            c.decode_idle_timeout = Some(BUDGET);
        });
    let (s, held) = match case.fault {
        Fault::PrefillRefused => {
            let (url, held) = held_dead_url();
            let s = builder.prefill(vec![]).dead_prefill(url).build().await;
            (s, Some(held))
        }
        Fault::DecodeRefused if p == Protocol::Lmcache => {
            // The decode's HTTP port refuses while its KV receiver works (the prefill's
            // push must succeed for the decode leg to be sent at all).
            let (url, held) = held_dead_url();
            let s = builder.build().await;
            let facts = Facts::default()
                .with(Facts::KV_RECEIVER, lmcache_receiver(s.d()).to_string())
                .expect("receiver fact");
            let decode = Endpoint::new(&url, Role::Decode)
                .expect("endpoint")
                .with_facts(facts);
            let prefill = s.source.snapshot().by_role(Role::Prefill).to_vec();
            s.source
                .replace(prefill.into_iter().chain([std::sync::Arc::new(decode)]));
            (s, Some(held))
        }
        Fault::DecodeRefused => {
            let (url, held) = held_dead_url();
            (builder.build_with_dead_decode(url).await, Some(held))
        }
        _ => (builder.build().await, None),
    };
    if p == Protocol::Mooncake && case.fault == Fault::MalformedHandoff {
        malform_bootstrap(&s).await;
    }
    (s, held)
}

/// Mooncake's malformed handoff: the prefill endpoint's bootstrap port now points at a
/// server whose `GET /query` answers 200 with a rank that carries no engine id.
async fn malform_bootstrap(s: &Stack) {
    let port = serve_forever(r#"{"0":{"worker_addr":{}}}"#).await;
    let facts = Facts::default()
        .with(Facts::BOOTSTRAP_PORT, port.to_string())
        .expect("bootstrap port fact");
    let prefill = Endpoint::new(&s.p().url(), Role::Prefill)
        .expect("prefill endpoint")
        .with_facts(facts);
    let decode = s.source.snapshot().by_role(Role::Decode).to_vec();
    s.source
        .replace(std::iter::once(std::sync::Arc::new(prefill)).chain(decode));
}

/// A loopback HTTP server that answers every request with 200 and `json`, until the
/// test's runtime ends; its port.
async fn serve_forever(json: &'static str) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{json}",
                    json.len()
                );
                let _ = sock.write_all(answer.as_bytes()).await;
            });
        }
    });
    port
}

/// Run one case: the request, the client's outcome and its time, then what is left.
async fn run(p: Protocol, case: Case) {
    let ctx = format!("{p:?} / {}", case.name);
    let (s, _held) = stack(p, &case).await;
    let (path, body) = if case.stream {
        ("/v1/chat/completions", chat(case.name, 8, true))
    } else {
        ("/v1/completions", completion(case.name, 8, false))
    };
    let start = Instant::now();
    let got = fetch(&s.url, path, body).await;
    let took = start.elapsed();
    let answered = Instant::now();

    check_outcome(&ctx, p, case.outcome, &got);
    if let Fault::PrefillStatus(code) = case.fault {
        let text = got
            .body
            .as_ref()
            .map(|b| String::from_utf8_lossy(b).into_owned());
        assert!(
            text.as_ref().is_ok_and(|t| t.contains(&code.to_string())),
            "{ctx}: the message names the engine's status: {text:?}"
        );
    }
    assert!(
        took >= case.min && took < case.max,
        "{ctx}: answered in {took:?}, expected {:?}..{:?}",
        case.min,
        case.max
    );

    // The engines that hold KV for a decode.
    let holders = if p == Protocol::Lmcache {
        &s.decode
    } else {
        &s.prefill
    };
    if case.kv == Kv::UntilLease {
        let st = holders[0].stats();
        assert!(
            st.blocks_held >= 1,
            "{ctx}: the KV handed over is held when the client is answered: {st:?}"
        );
        if p == Protocol::Mooncake {
            assert_eq!(st.kv_transfers_pending, 1, "{ctx}: {st:?}");
        }
    }

    // Nothing of the request is left on the proxy, and no engine still works on it.
    let engines = || s.prefill.iter().chain(&s.decode);
    let registered = || s.notifications.as_ref().map_or(0, |n| n.pending_len());
    let settled = eventually(SETTLE, || {
        let o = s.orchestrator.stats();
        s.in_flight() == 0
            && o.in_flight == 0
            && o.queued_now == 0
            && o.kv_releases_in_flight == 0
            && registered() == 0
            && engines().all(|e| e.stats().active_requests == 0)
    })
    .await;
    assert!(
        settled,
        "{ctx}: left over after {SETTLE:?}: {} in flight, {:?}, {} awaiting notifications, engines {:?}",
        s.in_flight(),
        s.orchestrator.stats(),
        registered(),
        engines().map(|e| e.stats()).collect::<Vec<_>>()
    );
    for &leg in &case.abandoned {
        let e = match leg {
            Leg::Prefill => s.p(),
            Leg::Decode => s.d(),
        };
        assert_eq!(
            e.stats().cancelled,
            1,
            "{ctx}: the {leg:?} request was dropped by the proxy: {:?}",
            e.stats()
        );
    }
    for &leg in &case.dropped_alongside {
        let st = match leg {
            Leg::Prefill => s.p(),
            Leg::Decode => s.d(),
        }
        .stats();
        assert!(
            st.http_connections >= 1 && st.requests <= 1 && st.cancelled == st.requests,
            "{ctx}: the {leg:?} leg was sent, and dropped by the proxy: {st:?}"
        );
    }
    if case.decode_untouched {
        assert_eq!(
            s.d().stats().requests,
            0,
            "{ctx}: no decode leg was sent: {:?}",
            s.d().stats()
        );
    }

    // The KV.
    match case.kv {
        Kv::Freed => {
            let freed = eventually(SETTLE, || {
                holders.iter().all(|e| {
                    let st = e.stats();
                    st.blocks_held == 0 && st.kv_transfers_pending == 0
                })
            })
            .await;
            assert!(
                freed,
                "{ctx}: KV left behind: {:?}",
                holders.iter().map(|e| e.stats()).collect::<Vec<_>>()
            );
        }
        Kv::UntilLease => {
            let h = &holders[0];
            let freed = eventually(LEASE_FREED, || {
                let st = h.stats();
                st.blocks_held == 0 && st.kv_transfers_pending == 0
            })
            .await;
            assert!(
                freed,
                "{ctx}: freed by the {SHORT_LEASE:?} lease: {:?}",
                h.stats()
            );
        }
    }

    // A leg the proxy failed to drop would have given up on its peer by now.
    tokio::time::sleep_until((answered + LINGER).into()).await;
    for e in engines() {
        let st = e.stats();
        assert_eq!(
            st.bootstrap_timeouts,
            0,
            "{ctx}: {} waited for a peer the proxy had dropped: {st:?}",
            e.url()
        );
        assert_eq!(st.active_requests, 0, "{ctx}: {} {st:?}", e.url());
    }
    if case.fault == Fault::BootstrapNeverMet {
        let d = s.d().stats();
        assert_eq!(
            d.kv_pull_failures, 0,
            "{ctx}: the decode leg was dropped before it gave up: {d:?}"
        );
    }
}

/// Assert that `got` is `want`.
fn check_outcome(ctx: &str, p: Protocol, want: Outcome, got: &Fetched) {
    let body = match &got.body {
        Ok(b) => b.clone(),
        Err(e) => {
            assert!(
                matches!(want, Outcome::BrokenBody),
                "{ctx}: the body broke ({e}), expected {want:?}"
            );
            assert_eq!(got.status, 200, "{ctx}: a broken body follows a 200 head");
            return;
        }
    };
    let text = String::from_utf8_lossy(&body);
    let json = || -> serde_json::Value {
        serde_json::from_slice(&body).unwrap_or_else(|e| panic!("{ctx}: not JSON ({e}): {text}"))
    };
    match want {
        Outcome::Error(status, code) => {
            assert_eq!(got.status, status, "{ctx}: {text}");
            let v = json();
            let e = &v["error"];
            assert_eq!(e["code"], code, "{ctx}: {v}");
            assert!(
                e["message"].as_str().is_some_and(|m| !m.is_empty()),
                "{ctx}: {v}"
            );
            assert_eq!(e["type"], "server_error", "{ctx}: {v}");
        }
        Outcome::DecodeAnswer(status) => {
            assert_eq!(got.status, status, "{ctx}: {text}");
            assert_eq!(
                got.headers
                    .get("x-disagg-failed-leg")
                    .and_then(|v| v.to_str().ok()),
                Some("decode"),
                "{ctx}"
            );
            let v = json();
            assert_eq!(
                v["error"]["code"], status,
                "{ctx}: the engine's own body: {v}"
            );
            assert!(
                v["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("Simulated fault")),
                "{ctx}: {v}"
            );
        }
        Outcome::StreamError(code) => {
            assert_eq!(got.status, 200, "{ctx}: {text}");
            let events = sse_payloads(&body);
            assert!(
                !events.iter().any(|e| e == "[DONE]"),
                "{ctx}: a broken stream must not end with [DONE]: {events:?}"
            );
            let last: serde_json::Value = events
                .last()
                .and_then(|e| serde_json::from_str(e).ok())
                .unwrap_or_else(|| panic!("{ctx}: no final JSON event: {events:?}"));
            assert_eq!(last["error"]["code"], code, "{ctx}: {events:?}");
            // LMCache's proxy sends vLLM's role-only chunk and the prefill's first token
            // (streams are chat here) before any of the decode's.
            let lead = 2 * usize::from(p == Protocol::Lmcache);
            assert_eq!(
                events.len(),
                lead + 3,
                "{ctx}: the two events before the fault, then the error: {events:?}"
            );
        }
        Outcome::BrokenBody => {
            panic!(
                "{ctx}: expected a broken body, got a complete one ({}): {text}",
                got.status
            )
        }
    }
}

/// Every case of `p`'s table, concurrently, each a task of its own (so the cases' clients
/// run on every worker of the runtime, not in turn in one task). A case that fails
/// fails the test with its own message.
async fn matrix(p: Protocol) {
    let cases = table(p);
    assert!(cases.len() >= 14, "{p:?}: {} cases", cases.len());
    let tasks: Vec<_> = cases.into_iter().map(|c| tokio::spawn(run(p, c))).collect();
    for task in tasks {
        if let Err(e) = task.await {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}

// Two workers: a case's stack, its engines and its client share the runtime with every
// other case of the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_fault_matrix() {
    matrix(Protocol::Nixl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_fault_matrix() {
    matrix(Protocol::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_fault_matrix() {
    matrix(Protocol::Mooncake).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_fault_matrix() {
    matrix(Protocol::Lmcache).await;
}
