//! ZMQ peers against the real `disagg-proxy serve` binary, over loopback TCP
//! (127.0.0.1, ephemeral ports).
//!
//! Untrusted peers: hand-written ZMTP bytes play the engines' KV-event publisher,
//! replay `ROUTER` and load publisher (the proxy connects to them) and LMCache's
//! prefill ranks (they connect to the proxy's notification socket). Each sends a frame
//! header announcing 1 TiB (or a 256 MiB notification); the proxy must stay up, keep
//! serving, keep its memory (its `VmHWM`) bounded, and count the refusal in `GET
//! /metrics`.
//!
//! The engines' own library: vLLM, SGLang and LMCache talk ZMQ through libzmq
//! (pyzmq), so pyzmq sockets play them too: a `PUB` of vLLM-shaped KV events and
//! SGLang load reports steers the proxy's routing, and `PUSH` sockets send the
//! KV-ready notifications that let LMCache requests complete, while one more sending
//! 1 MiB is cut off.

#![allow(missing_docs)] // a test binary

use std::io::{BufRead, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use disagg_sim::{Faults, KvEventsConfig, KvMode, LmcacheReceiver, SimConfig, SimEngine, SimRole};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::timeout;

mod common;
use common::{Answer, Proxy, completion, free_addr, get, post, python};

const PATIENCE: Duration = Duration::from_secs(20);

/// The proxy's memory must stay under this peak, whatever the peers announce: the
/// binary's own working set (two serving threads, the subscriber, the index) is
/// 10–30 MiB; a refused 1 TiB frame or a 256 MiB notification must add nothing near
/// their size (today's zeromq crate aborted on the first, kept 256 MiB for the second).
const PEAK_BOUND: u64 = 128 << 20;

/// The proxy's peak resident memory (`VmHWM`), in bytes.
fn peak(proxy: &Proxy) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", proxy.child.id()))
        .expect("read the proxy's /proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmHWM line");
    kib * 1024
}

fn alive(proxy: &mut Proxy) {
    assert!(
        matches!(proxy.child.try_wait(), Ok(None)),
        "the proxy died: {}",
        proxy.log()
    );
}

/// The value of the labelled series `series` (name and labels as printed) in
/// `/metrics`, 0 when absent.
async fn series(proxy: &Proxy, series: &str) -> u64 {
    let text = get(&proxy.url(), "/metrics").await.text();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0)
}

/// A ZMTP 3 greeting (NULL) and READY for a socket of type `socket_type`.
fn hello(socket_type: &str) -> Vec<u8> {
    let mut out = vec![0u8; 64];
    out[0] = 0xff;
    out[9] = 0x7f;
    out[10] = 3;
    out[12..16].copy_from_slice(b"NULL");
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    out.extend_from_slice(&[0x04, body.len() as u8]);
    out.extend_from_slice(&body);
    out
}

/// A frame header announcing 1 TiB.
fn bomb() -> Vec<u8> {
    let mut out = vec![0x02];
    out.extend_from_slice(&(1u64 << 40).to_be_bytes());
    out.extend_from_slice(b"only a few bytes follow");
    out
}

/// Reads until the peer closes: whether it did within `PATIENCE`.
async fn closed_by_peer(s: &mut TcpStream) -> bool {
    let mut sink = [0u8; 1024];
    loop {
        match timeout(PATIENCE, s.read(&mut sink)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

/// Plays a peer the proxy connects to: accepts, greets as `socket_type`, sends a
/// 1 TiB frame header, and reports whether the proxy then hung up; once.
fn bomber(listener: TcpListener, socket_type: &'static str) -> tokio::task::JoinHandle<bool> {
    tokio::spawn(async move {
        let Ok(Ok((mut s, _))) = timeout(PATIENCE, listener.accept()).await else {
            return false;
        };
        let mut greeting = hello(socket_type);
        greeting.extend_from_slice(&bomb());
        let _ = s.write_all(&greeting).await;
        closed_by_peer(&mut s).await
    })
}

async fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let endpoint = format!("tcp://{}", l.local_addr().expect("address"));
    (l, endpoint)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_bombs_on_the_kv_event_load_and_replay_sockets_are_refused_and_counted() {
    let prefill = SimEngine::start(SimConfig::default())
        .await
        .expect("prefill");
    let decode = SimEngine::start(SimConfig::default())
        .await
        .expect("decode");
    let (events, events_at) = listener().await;
    let (load, load_at) = listener().await;
    let (replay, replay_at) = listener().await;
    let spec = format!(
        "{}={events_at},replay={replay_at},load={load_at}",
        prefill.url()
    );
    let mut proxy = Proxy::start(
        &prefill,
        &decode,
        &[
            "--prefill-policy",
            "kv_events",
            "--tokenize",
            "engine",
            "--kv-events-endpoint",
            &spec,
        ],
    )
    .await;
    let base = peak(&proxy);

    // The load publisher and the replay ROUTER bomb at once.
    let load_bomb = bomber(load, "PUB");
    let replay_bomb = bomber(replay, "ROUTER");
    // The events publisher: a good batch (seq 0), then seq 5: a gap, so the proxy asks
    // the replay socket (which bombs); then a bomb of its own.
    let events_peer = tokio::spawn(async move {
        let (mut s, _) = events.accept().await.expect("the proxy subscribes");
        s.write_all(&hello("PUB")).await.expect("greet");
        let mut head = [0u8; 64 + 2 + 25 + 3];
        s.read_exact(&mut head)
            .await
            .expect("greeting, READY, subscription");
        // [topic, seq, payload]: an empty topic, [1.0, []] as msgpack.
        for seq in [0u64, 5] {
            let mut m = vec![0x01, 0x00, 0x01, 0x08];
            m.extend_from_slice(&seq.to_be_bytes());
            m.extend_from_slice(&[0x00, 0x0b, 0x92, 0xcb]);
            m.extend_from_slice(&1.0f64.to_be_bytes());
            m.push(0x90);
            s.write_all(&m).await.expect("batch");
        }
        s.write_all(&bomb()).await.expect("bomb");
        closed_by_peer(&mut s).await
    });
    assert!(load_bomb.await.unwrap(), "the load bomber stays connected");
    assert!(
        replay_bomb.await.unwrap(),
        "the replay bomber stays connected"
    );
    assert!(
        events_peer.await.unwrap(),
        "the events bomber stays connected"
    );

    let engine = prefill.url();
    let count = |socket: &str| {
        format!(
            "disagg_kv_events_malformed_total{{engine=\"{engine}\",rank=\"0\",socket=\"{socket}\",reason=\"oversized\"}}"
        )
    };
    let deadline = tokio::time::Instant::now() + PATIENCE;
    for socket in ["events", "replay", "load"] {
        while series(&proxy, &count(socket)).await < 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{socket}'s bomb not counted: {}",
                get(&proxy.url(), "/metrics").await.text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // The gap whose replay failed dropped the rank's entries.
    assert!(proxy.metric("disagg_kv_events_replay_failures_total").await >= 1);
    alive(&mut proxy);
    // Requests are still served (routed without the publisher's knowledge).
    let a = post(
        &proxy.url(),
        "/v1/completions",
        &completion("still up", 2, false),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.text());
    let grown = peak(&proxy).saturating_sub(base);
    assert!(
        peak(&proxy) < PEAK_BOUND,
        "peak {} MiB (grew {} MiB)",
        peak(&proxy) >> 20,
        grown >> 20
    );
}

/// An LMCache pair and a proxy with `--connector lmcache`, its notification socket
/// on `notify`.
async fn lmcache_proxy() -> (SimEngine, SimEngine, Proxy, String) {
    let notify = free_addr().to_string();
    let decode = SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Decode),
        lmcache_receiver: LmcacheReceiver::ephemeral(2),
        ..SimConfig::default()
    })
    .await
    .expect("decode sim");
    let prefill = SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Prefill),
        lmcache_proxy: Some(notify.clone()),
        ..SimConfig::default()
    })
    .await
    .expect("prefill sim");
    let join = |p: Vec<u16>| p.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    let receiver = format!(
        "{}=127.0.0.1:{}:{}",
        decode.url(),
        join(decode.lmcache_init_ports()),
        join(decode.lmcache_alloc_ports())
    );
    let proxy = Proxy::start(
        &prefill,
        &decode,
        &[
            "--connector",
            "lmcache",
            "--lmcache-notify",
            &notify,
            "--lmcache-receiver",
            &receiver,
        ],
    )
    .await;
    (prefill, decode, proxy, notify)
}

async fn chat_ok(proxy: &Proxy) {
    let body = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    })
    .to_string();
    let a = post(&proxy.url(), "/v1/chat/completions", &body).await;
    assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_notification_bombs_are_refused_and_requests_still_complete() {
    let (_prefill, _decode, mut proxy, notify) = lmcache_proxy().await;
    chat_ok(&proxy).await;
    let base = peak(&proxy);

    // A 1 TiB frame header.
    let mut s = TcpStream::connect(&notify).await.expect("connect");
    let mut bytes = hello("PUSH");
    bytes.extend_from_slice(&bomb());
    s.write_all(&bytes).await.expect("bomb");
    assert!(closed_by_peer(&mut s).await, "the bomber stays connected");

    // One 256 MiB notification, sent for real: the proxy hangs up at its header.
    let mut s = TcpStream::connect(&notify).await.expect("connect");
    let mut bytes = hello("PUSH");
    bytes.push(0x02);
    bytes.extend_from_slice(&(256u64 << 20).to_be_bytes());
    s.write_all(&bytes).await.expect("header");
    let chunk = vec![b'x'; 1 << 20];
    let mut sent = 0u64;
    for _ in 0..256 {
        if s.write_all(&chunk).await.is_err() {
            break;
        }
        sent += 1;
    }
    assert!(sent < 256, "the proxy read all 256 MiB");
    drop(s);

    let deadline = tokio::time::Instant::now() + PATIENCE;
    let oversized = "disagg_lmcache_notify_peers_rejected_total{reason=\"oversized\"}";
    while series(&proxy, oversized).await < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}",
            get(&proxy.url(), "/metrics").await.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    alive(&mut proxy);
    // The prefill's own notifications still complete requests.
    chat_ok(&proxy).await;
    let now = peak(&proxy);
    assert!(
        now < PEAK_BOUND && now.saturating_sub(base) < 32 << 20,
        "peak {} MiB, {} MiB over the start",
        now >> 20,
        now.saturating_sub(base) >> 20
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_from_a_publisher_over_the_message_ceiling_are_refused() {
    // --kv-events-max-message: a 64 KiB batch is refused at its header with the
    // ceiling at 16 KiB, then the publisher's next (small) batch is applied after the
    // back-off.
    let prefill = SimEngine::start(SimConfig {
        prefix_cache_blocks: 64,
        kv_events: Some(KvEventsConfig::default()),
        ..SimConfig::default()
    })
    .await
    .expect("prefill");
    let decode = SimEngine::start(SimConfig::default())
        .await
        .expect("decode");
    let (events, events_at) = listener().await;
    let spec = format!("{}={events_at}", prefill.url());
    let mut proxy = Proxy::start(
        &prefill,
        &decode,
        &[
            "--prefill-policy",
            "kv_events",
            "--tokenize",
            "engine",
            "--kv-events-endpoint",
            &spec,
            "--kv-events-max-message",
            "16384",
        ],
    )
    .await;
    let publisher = tokio::spawn(async move {
        let batch = |seq: u64, filler: usize| {
            let payload_len = 10 + 1 + filler;
            let mut m = vec![0x01, 0x00, 0x01, 0x08];
            m.extend_from_slice(&seq.to_be_bytes());
            m.push(0x02);
            m.extend_from_slice(&(payload_len as u64).to_be_bytes());
            // [1.0, [], "<filler>"]: the third field is the rank, ignored when not an int.
            m.extend_from_slice(&[0x93, 0xcb]);
            m.extend_from_slice(&1.0f64.to_be_bytes());
            m.push(0x90);
            m.extend(std::iter::repeat_n(0xc0, filler));
            m
        };
        let (mut s, _) = events.accept().await.expect("subscribe");
        s.write_all(&hello("PUB")).await.unwrap();
        let mut head = [0u8; 64 + 2 + 25 + 3];
        s.read_exact(&mut head).await.unwrap();
        s.write_all(&batch(0, 64 << 10)).await.unwrap();
        let refused = closed_by_peer(&mut s).await;
        // The proxy subscribes again (after its back-off): a small batch goes through.
        let (mut s, _) = events.accept().await.expect("subscribe again");
        s.write_all(&hello("PUB")).await.unwrap();
        s.read_exact(&mut head).await.unwrap();
        s.write_all(&batch(1, 1)).await.unwrap();
        (refused, s)
    });
    let (refused, _held) = timeout(PATIENCE, publisher)
        .await
        .expect("in time")
        .unwrap();
    assert!(refused, "a 64 KiB batch was taken under a 16 KiB ceiling");
    let engine = prefill.url();
    let oversized = format!(
        "disagg_kv_events_malformed_total{{engine=\"{engine}\",rank=\"0\",socket=\"events\",reason=\"oversized\"}}"
    );
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while proxy.metric("disagg_kv_events_batches_total").await < 1 {
        assert!(tokio::time::Instant::now() < deadline, "{}", proxy.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(series(&proxy, &oversized).await, 1);
    assert_eq!(proxy.metric("disagg_kv_events_ranks_connected").await, 1);
    alive(&mut proxy);
}

// === libzmq peers (pyzmq) ===

/// msgpack as msgspec writes it (the smallest form of each value), for the Python
/// peers: the test venv has pyzmq, not msgspec.
const PY_PACK: &str = r#"
import struct
def pack(v):
    if v is None: return b"\xc0"
    if isinstance(v, bool): return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        if 0 <= v < 0x80: return bytes([v])
        for tag, fmt, top in ((0xcc, ">B", 1 << 8), (0xcd, ">H", 1 << 16), (0xce, ">I", 1 << 32), (0xcf, ">Q", 1 << 64)):
            if 0 <= v < top: return bytes([tag]) + struct.pack(fmt, v)
        raise ValueError(v)
    if isinstance(v, float): return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        b = v.encode()
        if len(b) < 32: return bytes([0xa0 | len(b)]) + b
        if len(b) < 1 << 8: return b"\xd9" + struct.pack(">B", len(b)) + b
        if len(b) < 1 << 16: return b"\xda" + struct.pack(">H", len(b)) + b
        return b"\xdb" + struct.pack(">I", len(b)) + b
    if isinstance(v, (list, tuple)):
        head = bytes([0x90 | len(v)]) if len(v) < 16 else b"\xdc" + struct.pack(">H", len(v))
        return head + b"".join(pack(x) for x in v)
    if isinstance(v, dict):
        head = bytes([0x80 | len(v)]) if len(v) < 16 else b"\xde" + struct.pack(">H", len(v))
        return head + b"".join(pack(k) + pack(x) for k, x in v.items())
    raise TypeError(type(v))
"#;

/// A Python process with pyzmq running `script` (after [`PY_PACK`]) with `args`: told
/// what to do by lines on its stdin, answering by lines on its stdout; killed when
/// dropped.
struct PyPeer {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::UnboundedReceiver<String>,
}

impl PyPeer {
    fn start(script: &str, args: &[&str]) -> PyPeer {
        let mut child = Command::new(python("pyzmq"))
            .arg("-c")
            .arg(format!("{PY_PACK}\n{script}"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("run python");
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        PyPeer {
            child,
            stdin,
            lines,
        }
    }

    /// Its next line.
    async fn line(&mut self) -> String {
        match timeout(PATIENCE, self.lines.recv()).await {
            Ok(Some(line)) => line,
            Ok(None) => panic!("the Python peer exited: {:?}", self.child.try_wait()),
            Err(_) => panic!("the Python peer said nothing in {PATIENCE:?}"),
        }
    }

    fn say(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("write to the Python peer");
        self.stdin.flush().expect("flush");
    }
}

impl Drop for PyPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Two `PUSH` sockets as the prefill's two TP ranks (LMCache's `pd_backend` connects
/// one per rank to `pd_proxy_host:pd_proxy_port`), and a third that will send 1 MiB.
/// `notify ID`: each rank sends `msgspec.msgpack.encode(ProxyNotif(req_id=ID))`, the
/// tagged map `{"type": "ProxyNotif", "req_id": ID}`. `oversized`: the third sends a
/// notification with a 1 MiB id, and says `disconnected` once libzmq saw the proxy
/// hang up.
const LMCACHE_RANKS: &str = r#"
import sys, zmq
from zmq.utils.monitor import recv_monitor_message
ctx = zmq.Context()
addr = "tcp://" + sys.argv[1]
ranks = []
for _ in range(2):
    s = ctx.socket(zmq.PUSH); s.setsockopt(zmq.LINGER, 0); s.connect(addr); ranks.append(s)
bad = ctx.socket(zmq.PUSH); bad.setsockopt(zmq.LINGER, 0)
monitor = bad.get_monitor_socket(zmq.EVENT_DISCONNECTED)
bad.connect(addr)
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "notify":
        for s in ranks:
            s.send(pack({"type": "ProxyNotif", "req_id": arg}))
        print("sent", flush=True)
    elif cmd == "oversized":
        bad.send(pack({"type": "ProxyNotif", "req_id": "x" * (1 << 20)}))
        seen = "connected"
        while monitor.poll(15000):
            if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
                seen = "disconnected"
                break
        bad.close()
        print(seen, flush=True)
"#;

/// The `req_id` of the LMCache prefill request `prefill` received after its first
/// `seen` ones (the proxy's `kv_transfer_params.disagg_spec.req_id`).
async fn lmcache_req_id(prefill: &SimEngine, seen: usize) -> String {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(r) = prefill.requests().get(seen) {
            let id = &r.body["kv_transfer_params"]["disagg_spec"]["req_id"];
            return id.as_str().expect("a string req_id").to_owned();
        }
        assert!(tokio::time::Instant::now() < deadline, "no prefill request");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A chat request through `proxy`, on a task of its own.
fn chat(proxy: &Proxy) -> tokio::task::JoinHandle<Answer> {
    let url = proxy.url();
    tokio::spawn(async move {
        let body = serde_json::json!({
            "model": "sim-model",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
        })
        .to_string();
        post(&url, "/v1/chat/completions", &body).await
    })
}

/// LMCache's prefill ranks as libzmq `PUSH` sockets: the simulated prefill loses
/// every notification of its own, so each request's decode leg waits for the ones
/// pyzmq sends for it, and completes with them. A third pyzmq `PUSH` sending a 1 MiB
/// notification (64 KiB is the ceiling) is hung up on and counted, while the two
/// ranks, connected throughout, carry the next request's notifications.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libzmq_push_notifications_complete_lmcache_requests_and_1_mib_is_cut_off() {
    let notify = free_addr().to_string();
    let decode = SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Decode),
        lmcache_receiver: LmcacheReceiver::ephemeral(2),
        ..SimConfig::default()
    })
    .await
    .expect("decode sim");
    let prefill = SimEngine::start(SimConfig {
        kv_mode: KvMode::Lmcache(SimRole::Prefill),
        lmcache_proxy: Some(notify.clone()),
        faults: Faults {
            notify_loss: 1.0,
            ..Faults::default()
        },
        ..SimConfig::default()
    })
    .await
    .expect("prefill sim");
    let join = |p: Vec<u16>| p.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    let receiver = format!(
        "{}=127.0.0.1:{}:{}",
        decode.url(),
        join(decode.lmcache_init_ports()),
        join(decode.lmcache_alloc_ports())
    );
    let mut proxy = Proxy::start(
        &prefill,
        &decode,
        &[
            "--connector",
            "lmcache",
            "--lmcache-notify",
            &notify,
            "--lmcache-receiver",
            &receiver,
            // Without the notifications a request fails after this: 504.
            "--handoff-timeout",
            "5",
        ],
    )
    .await;
    let mut ranks = PyPeer::start(LMCACHE_RANKS, &[&notify]);
    assert_eq!(ranks.line().await, "ready");

    let answer = chat(&proxy);
    let id = lmcache_req_id(&prefill, 0).await;
    ranks.say(&format!("notify {id}"));
    assert_eq!(ranks.line().await, "sent");
    let a = answer.await.unwrap();
    assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));

    // The next request waits while a third peer sends 1 MiB: cut off at the header.
    let answer = chat(&proxy);
    let id = lmcache_req_id(&prefill, 1).await;
    ranks.say("oversized");
    assert_eq!(ranks.line().await, "disconnected");
    let oversized = "disagg_lmcache_notify_peers_rejected_total{reason=\"oversized\"}";
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while series(&proxy, oversized).await < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}",
            get(&proxy.url(), "/metrics").await.text()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    ranks.say(&format!("notify {id}"));
    assert_eq!(ranks.line().await, "sent");
    let a = answer.await.unwrap();
    assert_eq!(a.status, 200, "{}\n{}", a.text(), proxy.log());
    assert_eq!(a.header("x-disagg-handoff"), Some("kv"));

    // Both decodes used the KV the prefill pushed, made ready by pyzmq's
    // notifications alone: the prefill sent none.
    let (d, p) = (decode.stats(), prefill.stats());
    assert_eq!(
        (d.remote_decodes, d.local_prefills, d.kv_missing),
        (2, 0, 0)
    );
    assert_eq!((p.notifications_sent, p.notifications_lost), (0, 4));
    let outcome = |o: &str| format!("disagg_lmcache_notifications_total{{outcome=\"{o}\"}}");
    assert_eq!(series(&proxy, &outcome("matched")).await, 4);
    // The 1 MiB notification was never read as one.
    assert_eq!(series(&proxy, &outcome("malformed")).await, 0);
    alive(&mut proxy);
}

/// Plays an SGLang-like engine's publishers with libzmq `XPUB` sockets (a `PUB` that
/// also hears subscriptions, so nothing is published before the proxy subscribed):
/// once the proxy subscribed to both, one vLLM-shaped batch (`[ts, [BlockStored],
/// dp_rank]`, map-tagged) stores the token ids of argv[1] (comma-separated, 16 per
/// block), and a `LoadStat` report goes out every 20 ms: idle until `busy` on stdin,
/// then 1 running and 8 waiting with 100,000 uncached tokens; it says `busy N` once
/// the first busy report, its `N`th, was published.
const SGLANG_PUBLISHERS: &str = r#"
import sys, time, zmq
tokens = [int(t) for t in sys.argv[1].split(",")]
ctx = zmq.Context()
events = ctx.socket(zmq.XPUB); ep = events.bind_to_random_port("tcp://127.0.0.1")
load = ctx.socket(zmq.XPUB); lp = load.bind_to_random_port("tcp://127.0.0.1")
print(ep, lp, flush=True)
for s, topic in ((events, b""), (load, b"load")):
    if not s.poll(15000): sys.exit("no subscription")
    got = s.recv()
    if got != b"\x01" + topic: sys.exit("subscribed to %r" % got)
stored = {"type": "BlockStored", "block_hashes": [0x5EED0000 + i for i in range(len(tokens) // 16)],
          "parent_block_hash": None, "token_ids": tokens, "block_size": 16, "lora_id": None,
          "medium": "GPU", "lora_name": None}
events.send_multipart([b"", struct.pack(">Q", 0), pack([time.time(), [stored], 0])])
def stat(busy):
    return pack(["LoadStat", 1 if busy else 0, 8 if busy else 0, 0, 100000, 0, 100000 if busy else 0])
poller = zmq.Poller(); poller.register(sys.stdin, zmq.POLLIN)
busy, announce, sent = False, False, 0
while True:
    load.send_multipart([b"load", struct.pack(">Q", sent), stat(busy)]); sent += 1
    if announce:
        print("busy", sent, flush=True); announce = False
    if poller.poll(20):
        line = sys.stdin.readline()
        if not line: break
        busy = announce = line.strip() == "busy"
"#;

/// Sends `prompt` through `proxy`; which of `prefills` got its prefill leg.
async fn routed(proxy: &Proxy, prefills: &[&SimEngine], prompt: &str) -> usize {
    let before: Vec<u64> = prefills
        .iter()
        .map(|e| e.stats().prefill_requests)
        .collect();
    let a = post(
        &proxy.url(),
        "/v1/completions",
        &completion(prompt, 2, false),
    )
    .await;
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

async fn metric_at_least(proxy: &Proxy, name: &str, n: u64) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while proxy.metric(name).await < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name} < {n}: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A libzmq publisher through the real binary: pyzmq plays the KV-event and load
/// publishers of the second of two prefill engines. Its events say it holds the
/// prompt's 96 tokens: the prompt goes there (without them, to the first: a tie);
/// once its load reports say 100,000 uncached tokens wait there, the same prompt goes
/// to the first engine instead (without them, the held prefix keeps it on the second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_and_load_reports_from_libzmq_publishers_steer_the_proxy() {
    let first = SimEngine::start(SimConfig::default()).await.expect("first");
    let second = SimEngine::start(SimConfig::default())
        .await
        .expect("second");
    let decode = SimEngine::start(SimConfig::default())
        .await
        .expect("decode");
    // 6 blocks of 16 tokens and one more: every block can hit.
    let prompt = (0..97)
        .map(|i| format!("libzmq{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let tokens: Vec<String> = disagg_sim::tokenize(&prompt)[..96]
        .iter()
        .map(u32::to_string)
        .collect();
    let mut publisher = PyPeer::start(SGLANG_PUBLISHERS, &[&tokens.join(",")]);
    let ports = publisher.line().await;
    let (events_port, load_port) = ports.split_once(' ').expect("two ports");
    let spec = format!(
        "{}=tcp://127.0.0.1:{events_port},load=tcp://127.0.0.1:{load_port}",
        second.url()
    );
    let proxy = Proxy::start_args(
        &[
            "--prefill",
            &first.url(),
            "--prefill",
            &second.url(),
            "--decode",
            &decode.url(),
            "--prefill-policy",
            "kv_events",
            "--tokenize",
            "engine",
            "--kv-events-endpoint",
            &spec,
        ]
        .map(str::to_owned),
    )
    .await;
    metric_at_least(&proxy, "disagg_kv_events_batches_total", 1).await;
    metric_at_least(&proxy, "disagg_kv_events_load_reports_total", 1).await;
    assert_eq!(routed(&proxy, &[&first, &second], &prompt).await, 1);

    publisher.say("busy");
    let busy = publisher.line().await;
    let n: u64 = busy
        .strip_prefix("busy ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{busy}"));
    // The reports are in order and none was published before the subscription.
    metric_at_least(&proxy, "disagg_kv_events_load_reports_total", n).await;
    assert_eq!(routed(&proxy, &[&first, &second], &prompt).await, 0);
    assert_eq!(
        proxy
            .metric("disagg_kv_events_load_decode_errors_total")
            .await,
        0
    );
    assert_eq!(proxy.metric("disagg_kv_events_drops_total").await, 0);
    // Exposed with the rest: a healthy publisher expires nothing and skips no block.
    assert_eq!(proxy.metric("disagg_kv_events_expiries_total").await, 0);
    assert_eq!(
        proxy.metric("disagg_kv_events_skipped_blocks_total").await,
        0
    );
}
