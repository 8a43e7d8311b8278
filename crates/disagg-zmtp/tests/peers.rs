//! The sockets against real peers over loopback TCP (127.0.0.1, ephemeral ports):
//! the `zeromq` crate's `PUB`, `ROUTER` and `PUSH` (what the simulator uses), libzmq's
//! through pyzmq (what vLLM, SGLang and LMCache use), and hand-written bytes for the
//! hostile ones: frame bombs, too many frames, wrong socket types, silent peers.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use disagg_zmtp::{Dealer, Error, Limits, Pull, PullConfig, Reject, Sub};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const PATIENCE: Duration = Duration::from_secs(10);
const CONNECT: Duration = Duration::from_secs(2);

fn limits() -> Limits {
    Limits {
        handshake_timeout: Duration::from_millis(500),
        ..Limits::new(64 * 1024)
    }
}

/// The Python with pyzmq: `$DISAGG_PYTHON`, else the repository's `.venv`
/// (scripts/test.sh creates it).
fn python() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("DISAGG_PYTHON") {
        return p.into();
    }
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    assert!(
        venv.exists(),
        "no Python with pyzmq: run scripts/test.sh (it creates .venv), or set DISAGG_PYTHON"
    );
    venv
}

/// Runs `script` under pyzmq; its first stdout line is returned (e.g. a bound port).
fn pyzmq(script: &str) -> (Child, String) {
    let mut child = Command::new(python())
        .args(["-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run python");
    let mut out = child.stdout.take().expect("stdout");
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while std::io::Read::read(&mut out, &mut byte).unwrap_or(0) == 1 && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    (child, String::from_utf8_lossy(&line).into_owned())
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Our greeting as a peer of type `socket_type` would send it, then its READY.
fn hello(socket_type: &str) -> Vec<u8> {
    let mut out = disagg_zmtp::wire::greeting(false).to_vec();
    out.extend_from_slice(&disagg_zmtp::wire::encode_ready(socket_type));
    out
}

/// A long frame header announcing `len` bytes.
fn long_header(more: bool, len: u64) -> Vec<u8> {
    let mut out = vec![0x02 | u8::from(more)];
    out.extend_from_slice(&len.to_be_bytes());
    out
}

/// A frame of `body` (short or long form).
fn frame(more: bool, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    disagg_zmtp::wire::encode_header(more, false, body.len(), &mut out);
    out.extend_from_slice(body);
    out
}

/// Reads until the peer closes (or `PATIENCE`): whether it closed.
async fn closed_by_peer(stream: &mut TcpStream) -> bool {
    let mut sink = [0u8; 1024];
    loop {
        match timeout(PATIENCE, stream.read(&mut sink)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

async fn pull() -> Pull {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    Pull::from_listener(listener, PullConfig::new(limits())).expect("pull")
}

async fn recv_pull(pull: &mut Pull) -> Vec<Bytes> {
    timeout(PATIENCE, pull.recv())
        .await
        .expect("in time")
        .expect("a message")
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn sub_receives_from_the_zeromq_crates_pub() {
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("bind")
        .to_string();
    let mut sub = Sub::connect(&endpoint, b"kv", limits(), CONNECT)
        .await
        .expect("sub");
    // A PUB drops what it sends before the subscription reached it: publish until one
    // arrives, with a topic the filter drops in between.
    let publishing = tokio::spawn(async move {
        loop {
            let other: Vec<Bytes> = vec![Bytes::from_static(b"zz"), Bytes::from_static(b"x")];
            publisher
                .send(ZmqMessage::try_from(other).unwrap())
                .await
                .unwrap();
            let wanted: Vec<Bytes> =
                vec![Bytes::from_static(b"kv"), Bytes::from_static(b"payload")];
            publisher
                .send(ZmqMessage::try_from(wanted).unwrap())
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let received = timeout(PATIENCE, sub.recv())
        .await
        .expect("in time")
        .expect("a message");
    publishing.abort();
    assert_eq!(received, [&b"kv"[..], &b"payload"[..]]);
}

#[tokio::test]
async fn dealer_talks_to_the_zeromq_crates_router() {
    let mut router = zeromq::RouterSocket::new();
    let endpoint = router
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("bind")
        .to_string();
    let mut dealer = Dealer::connect(&endpoint, limits(), CONNECT)
        .await
        .expect("dealer");
    dealer.send(&[b"", b"question"]).await.expect("send");
    let request = timeout(PATIENCE, router.recv())
        .await
        .expect("in time")
        .expect("recv");
    let frames = request.into_vec();
    assert_eq!(frames.len(), 3, "identity, delimiter, request");
    assert_eq!(
        (&frames[1][..], &frames[2][..]),
        (&b""[..], &b"question"[..])
    );
    let answer = vec![
        frames[0].clone(),
        Bytes::new(),
        Bytes::from_static(b"a"),
        Bytes::from_static(b"b"),
    ];
    router
        .send(ZmqMessage::try_from(answer).unwrap())
        .await
        .expect("send");
    let got = timeout(PATIENCE, dealer.recv())
        .await
        .expect("in time")
        .expect("answer");
    assert_eq!(got, [&b""[..], &b"a"[..], &b"b"[..]]);
}

#[tokio::test]
async fn pull_takes_messages_from_zeromq_crate_pushers() {
    let mut pull = pull().await;
    let endpoint = format!("tcp://{}", pull.local_addr());
    let mut pushers = Vec::new();
    for i in 0..2u8 {
        let mut push = zeromq::PushSocket::new();
        push.connect(&endpoint).await.expect("connect");
        push.send(ZmqMessage::from(vec![i; 3])).await.expect("send");
        pushers.push(push);
    }
    let mut got = vec![recv_pull(&mut pull).await, recv_pull(&mut pull).await];
    got.sort();
    assert_eq!(
        got,
        [
            vec![Bytes::from(vec![0u8; 3])],
            vec![Bytes::from(vec![1u8; 3])]
        ]
    );
    assert_eq!(pull.stats().messages, 2);
}

#[tokio::test]
async fn every_socket_interoperates_with_libzmq() {
    // libzmq's PUB, ROUTER and PUSH (pyzmq), each on an ephemeral loopback port.
    let script = r#"
import sys, time, zmq
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB); pp = pub.bind_to_random_port("tcp://127.0.0.1")
router = ctx.socket(zmq.ROUTER); rp = router.bind_to_random_port("tcp://127.0.0.1")
print(pp, rp, flush=True)
poller = zmq.Poller(); poller.register(router, zmq.POLLIN)
end = time.time() + 20
while time.time() < end:
    pub.send_multipart([b"kv", b"\x00" * 8, b"event"])
    if poller.poll(10):
        ident, empty, req = router.recv_multipart()
        router.send_multipart([ident, b"", b"kv", b"seq", req])
        router.send_multipart([ident, b"", b"", b"end", b""])
"#;
    let (child, ports) = pyzmq(script);
    let _child = Killed(child);
    let mut ports = ports.split_whitespace();
    let (pub_port, router_port) = (
        ports.next().expect("pub port"),
        ports.next().expect("router port"),
    );

    let mut sub = Sub::connect(
        &format!("tcp://127.0.0.1:{pub_port}"),
        b"kv",
        limits(),
        CONNECT,
    )
    .await
    .expect("sub to libzmq");
    let m = timeout(PATIENCE, sub.recv())
        .await
        .expect("in time")
        .expect("message");
    assert_eq!(m, [&b"kv"[..], &[0u8; 8][..], &b"event"[..]]);

    let mut dealer = Dealer::connect(&format!("tcp://127.0.0.1:{router_port}"), limits(), CONNECT)
        .await
        .expect("dealer to libzmq");
    dealer.send(&[b"", b"replay-from-7"]).await.expect("send");
    let a = timeout(PATIENCE, dealer.recv())
        .await
        .expect("in time")
        .expect("answer");
    assert_eq!(
        a,
        [&b""[..], &b"kv"[..], &b"seq"[..], &b"replay-from-7"[..]]
    );
    let end = timeout(PATIENCE, dealer.recv())
        .await
        .expect("in time")
        .expect("end");
    assert_eq!(end.len(), 4);

    // libzmq PUSH peers into our PULL.
    let mut pull = pull().await;
    let push = format!(
        r#"
import zmq
ctx = zmq.Context()
for i in range(2):
    s = ctx.socket(zmq.PUSH); s.connect("tcp://{}")
    s.send_multipart([b"libzmq", bytes([i])])
    s.close(linger=5000)
print("sent", flush=True)
"#,
        pull.local_addr()
    );
    let (child, line) = pyzmq(&push);
    let _push = Killed(child);
    assert_eq!(line, "sent");
    let mut got = [recv_pull(&mut pull).await, recv_pull(&mut pull).await];
    got.sort();
    assert_eq!(got[0], [&b"libzmq"[..], &[0u8][..]]);
    assert_eq!(got[1], [&b"libzmq"[..], &[1u8][..]]);
}

#[tokio::test]
async fn a_frame_bomb_disconnects_one_pull_peer_and_the_others_go_on() {
    let mut pull = pull().await;
    let addr = pull.local_addr();
    let mut bomber = TcpStream::connect(addr).await.expect("connect");
    bomber.write_all(&hello("PUSH")).await.expect("hello");
    // 1 TiB announced, a few bytes sent.
    bomber
        .write_all(&long_header(false, 1 << 40))
        .await
        .expect("bomb");
    bomber.write_all(b"xxxx").await.expect("bytes");
    assert!(
        closed_by_peer(&mut bomber).await,
        "the bomber stays connected"
    );
    eventually("the bomb counted", || pull.stats().oversized == 1).await;

    let mut push = zeromq::PushSocket::new();
    push.connect(&format!("tcp://{addr}"))
        .await
        .expect("connect");
    push.send(ZmqMessage::from(b"still here".to_vec()))
        .await
        .expect("send");
    assert_eq!(recv_pull(&mut pull).await, [&b"still here"[..]]);
}

#[tokio::test]
async fn pull_refuses_too_many_frames_a_message_over_the_cap_and_bad_peers() {
    let mut pull = pull().await;
    let addr = pull.local_addr();
    let cap = limits();

    // Frames each small, too many of them.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut bytes = hello("PUSH");
    for _ in 0..=cap.max_frames {
        bytes.extend_from_slice(&frame(true, b"f"));
    }
    s.write_all(&bytes).await.unwrap();
    assert!(closed_by_peer(&mut s).await);

    // Frames each under the frame cap, their sum over the message cap.
    let mut limits_small = limits();
    limits_small.max_frame = 40 * 1024;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut small = Pull::from_listener(listener, PullConfig::new(limits_small)).unwrap();
    let mut s2 = TcpStream::connect(small.local_addr()).await.unwrap();
    let mut bytes = hello("PUSH");
    bytes.extend_from_slice(&frame(true, &vec![1u8; 40 * 1024]));
    bytes.extend_from_slice(&frame(false, &vec![1u8; 40 * 1024]));
    s2.write_all(&bytes).await.unwrap();
    assert!(closed_by_peer(&mut s2).await);
    eventually("the message counted", || small.stats().oversized == 1).await;
    assert!(
        timeout(Duration::from_millis(100), small.recv())
            .await
            .is_err(),
        "nothing delivered"
    );

    // A PUB is not a PUSH; a greeting with another mechanism; a reserved flag bit.
    let mut wrong_type = TcpStream::connect(addr).await.unwrap();
    wrong_type.write_all(&hello("PUB")).await.unwrap();
    assert!(closed_by_peer(&mut wrong_type).await);
    let mut curve = TcpStream::connect(addr).await.unwrap();
    let mut g = disagg_zmtp::wire::greeting(false);
    g[12..17].copy_from_slice(b"CURVE");
    curve.write_all(&g).await.unwrap();
    assert!(closed_by_peer(&mut curve).await);
    let mut flags = TcpStream::connect(addr).await.unwrap();
    let mut bytes = hello("PUSH");
    bytes.extend_from_slice(&[0x80, 1, 0]);
    flags.write_all(&bytes).await.unwrap();
    assert!(closed_by_peer(&mut flags).await);

    // A peer that never greets is dropped after the handshake time.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    assert!(closed_by_peer(&mut silent).await);

    eventually("every reject counted", || {
        let s = pull.stats();
        s.oversized == 1 && s.protocol == 3 && s.timeout == 1
    })
    .await;
    let mut push = zeromq::PushSocket::new();
    push.connect(&format!("tcp://{addr}")).await.unwrap();
    push.send(ZmqMessage::from(b"ok".to_vec())).await.unwrap();
    assert_eq!(recv_pull(&mut pull).await, [&b"ok"[..]]);
}

#[tokio::test]
async fn pull_closes_peers_beyond_its_maximum() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = PullConfig {
        max_peers: 2,
        ..PullConfig::new(Limits {
            handshake_timeout: PATIENCE,
            ..limits()
        })
    };
    let pull = Pull::from_listener(listener, config).unwrap();
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(pull.local_addr()).await.unwrap();
        s.write_all(&hello("PUSH")).await.unwrap();
        held.push(s);
    }
    eventually("two peers", || pull.stats().peers == 2).await;
    let mut third = TcpStream::connect(pull.local_addr()).await.unwrap();
    assert!(closed_by_peer(&mut third).await);
    assert_eq!(pull.stats().refused, 1);
}

/// How long a peer must be idle before a newcomer may take its place, in the eviction
/// tests: long enough that the steps meant to come "too soon" (a few connections and
/// handshakes) come within it on a loaded machine.
const EVICT_IDLE_AFTER: Duration = Duration::from_secs(2);

/// At its maximum, a newcomer takes the place of the peer idle longest once that one
/// has been idle past `evict_idle_after`; a peer heard from since keeps its place.
#[tokio::test]
async fn pull_makes_room_by_closing_its_longest_idle_peer() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = PullConfig {
        max_peers: 2,
        evict_idle_after: EVICT_IDLE_AFTER,
        ..PullConfig::new(Limits {
            handshake_timeout: PATIENCE,
            ..limits()
        })
    };
    let mut pull = Pull::from_listener(listener, config).unwrap();
    let addr = pull.local_addr();
    // An idle peer (greets, then nothing), then a live one.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(&hello("PUSH")).await.unwrap();
    eventually("the idle peer", || pull.stats().peers == 1).await;
    let mut live = zeromq::PushSocket::new();
    live.connect(&format!("tcp://{addr}")).await.unwrap();
    eventually("two peers", || pull.stats().peers == 2).await;
    // Too soon: nobody has been idle long enough, the newcomer is closed.
    let mut early = TcpStream::connect(addr).await.unwrap();
    assert!(closed_by_peer(&mut early).await);
    assert_eq!(pull.stats().refused, 1);
    tokio::time::sleep(EVICT_IDLE_AFTER + Duration::from_millis(100)).await;
    live.send(ZmqMessage::from(b"still here".to_vec()))
        .await
        .unwrap();
    assert_eq!(recv_pull(&mut pull).await, [&b"still here"[..]]);
    // Now the idle peer makes room; the live one stays.
    let mut newcomer = zeromq::PushSocket::new();
    newcomer.connect(&format!("tcp://{addr}")).await.unwrap();
    assert!(closed_by_peer(&mut idle).await, "the idle peer was closed");
    newcomer
        .send(ZmqMessage::from(b"new".to_vec()))
        .await
        .unwrap();
    assert_eq!(recv_pull(&mut pull).await, [&b"new"[..]]);
    live.send(ZmqMessage::from(b"live".to_vec())).await.unwrap();
    assert_eq!(recv_pull(&mut pull).await, [&b"live"[..]]);
    let stats = pull.stats();
    assert_eq!((stats.evicted, stats.refused), (1, 1));
}

/// A `PUSH` greeting sent to `addr` from the loopback address `ip` (Linux answers for
/// all of 127.0.0.0/8): a peer on a host of its own.
async fn push_from(ip: &str, addr: std::net::SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
    let mut s = socket.connect(addr).await.unwrap();
    s.write_all(&hello("PUSH")).await.unwrap();
    s
}

/// Whether `stream` is still open after `wait` (what the socket sent meanwhile read).
async fn still_open(stream: &mut TcpStream, wait: Duration) -> bool {
    let mut sink = [0u8; 1024];
    let until = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(until, stream.read(&mut sink)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return false,
            Ok(Ok(_)) => {}
            Err(_) => return true,
        }
    }
}

/// One host holds at most `max_peers_per_host` places: its next connection is closed
/// while its peers are busy, or takes the place of its own peer idle longest (not
/// another host's, even one idle longer); other hosts still get in.
// Linux answers for every address of 127.0.0.0/8; other systems may not.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn pull_limits_the_peers_of_one_host() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = PullConfig {
        max_peers: 8,
        max_peers_per_host: 2,
        evict_idle_after: EVICT_IDLE_AFTER,
        ..PullConfig::new(Limits {
            handshake_timeout: PATIENCE,
            ..limits()
        })
    };
    let pull = Pull::from_listener(listener, config).unwrap();
    let addr = pull.local_addr();
    // Host B's peer first: idle longest of all from here on.
    let mut b1 = push_from("127.0.0.3", addr).await;
    eventually("host B's peer", || pull.stats().peers == 1).await;
    let mut a1 = push_from("127.0.0.2", addr).await;
    eventually("a first peer of host A", || pull.stats().peers == 2).await;
    let mut a2 = push_from("127.0.0.2", addr).await;
    eventually("host A's two peers", || pull.stats().peers == 3).await;
    // Too soon for anyone to be idle: host A's third is closed, though the socket has
    // room for five more.
    let mut a3 = push_from("127.0.0.2", addr).await;
    assert!(closed_by_peer(&mut a3).await);
    let stats = pull.stats();
    assert_eq!(
        (stats.refused_per_host, stats.refused, stats.peers),
        (1, 0, 3)
    );
    // Idle now: host A's next takes the place of host A's idlest, and host B's
    // (idle longer) keeps its own.
    tokio::time::sleep(EVICT_IDLE_AFTER + Duration::from_millis(100)).await;
    let mut a4 = push_from("127.0.0.2", addr).await;
    assert!(
        closed_by_peer(&mut a1).await,
        "host A's idlest peer was closed"
    );
    assert!(still_open(&mut b1, Duration::from_millis(300)).await);
    assert!(still_open(&mut a2, Duration::from_millis(10)).await);
    assert!(still_open(&mut a4, Duration::from_millis(10)).await);
    // Another host still gets in.
    let mut b2 = push_from("127.0.0.3", addr).await;
    eventually("host B's second peer", || pull.stats().accepted == 5).await;
    eventually("four peers", || pull.stats().peers == 4).await;
    assert!(still_open(&mut b2, Duration::from_millis(10)).await);
    let stats = pull.stats();
    assert_eq!(
        (stats.evicted, stats.refused_per_host, stats.refused),
        (1, 1, 0)
    );
}

/// A hand-written publisher on `listener`: greets as `socket_type`, then sends
/// `bytes` and holds the connection until the subscriber closes it.
async fn publisher(listener: TcpListener, socket_type: &'static str, bytes: Vec<u8>) -> bool {
    let (mut s, _) = listener.accept().await.expect("accept");
    s.write_all(&hello(socket_type)).await.expect("hello");
    let _ = s.write_all(&bytes).await;
    closed_by_peer(&mut s).await
}

#[tokio::test]
async fn sub_and_dealer_refuse_a_frame_bomb_at_its_header() {
    for dealer in [false, true] {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
        let mut bomb = frame(true, b"topic");
        bomb.extend_from_slice(&long_header(false, 1 << 40));
        let ty = if dealer { "ROUTER" } else { "PUB" };
        let peer = tokio::spawn(publisher(listener, ty, bomb));
        let got = if dealer {
            let mut d = Dealer::connect(&endpoint, limits(), CONNECT)
                .await
                .expect("dealer");
            timeout(PATIENCE, d.recv()).await.expect("in time")
        } else {
            let mut s = Sub::connect(&endpoint, b"", limits(), CONNECT)
                .await
                .expect("sub");
            let got = timeout(PATIENCE, s.recv()).await.expect("in time");
            drop(s);
            got
        };
        let error = got.expect_err("a 1 TiB frame refused");
        assert!(
            matches!(error, Error::FrameTooLarge { len, .. } if len == 1 << 40),
            "{error}"
        );
        assert_eq!(error.reject(), Reject::Oversized);
        assert!(peer.await.unwrap(), "the bomber was disconnected");
    }
}

#[tokio::test]
async fn sub_answers_ping_and_refuses_the_wrong_peer_type() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let peer = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        s.write_all(&hello("PUB")).await.unwrap();
        // Their greeting (64), READY (2 + 25), then the subscription frame (2 + 1).
        let mut head = vec![0u8; 64 + 2 + 25 + 3];
        s.read_exact(&mut head).await.unwrap();
        assert_eq!(
            &head[head.len() - 3..],
            &[0x00, 0x01, 0x01][..],
            "subscribe to all"
        );
        s.write_all(b"\x04\x0a\x04PING\x00\x01abc").await.unwrap();
        let mut pong = [0u8; 2 + 5 + 3];
        s.read_exact(&mut pong).await.unwrap();
        s.write_all(&frame(false, b"after ping")).await.unwrap();
        pong
    });
    let mut sub = Sub::connect(&endpoint, b"", limits(), CONNECT)
        .await
        .expect("sub");
    let m = timeout(PATIENCE, sub.recv()).await.unwrap().unwrap();
    assert_eq!(m, [&b"after ping"[..]]);
    assert_eq!(&peer.await.unwrap(), b"\x04\x08\x04PONGabc");

    // A PUSH where a PUB should be.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(publisher(listener, "PUSH", Vec::new()));
    let error = Sub::connect(&endpoint, b"", limits(), CONNECT)
        .await
        .expect_err("refused");
    assert_eq!(error.reject(), Reject::Protocol, "{error}");
}

/// A host that never completes the TCP handshake (here a listener whose accept queue
/// is full: the kernel drops the SYNs) is nobody there, an I/O time-out that callers
/// retry soon ([`Reject::Disconnected`]); a peer that accepts and never greets is
/// slow in the ZMTP handshake ([`Reject::Timeout`]), which callers count against it.
/// Before, both were [`Error::HandshakeTimeout`].
#[tokio::test]
async fn a_tcp_connect_timeout_is_not_a_handshake_timeout() {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let full = socket.listen(0).unwrap();
    let addr = full.local_addr().unwrap();
    // Fill the accept queue (never accepted): connections until one no longer
    // completes.
    let mut queued = Vec::new();
    for _ in 0..64 {
        match timeout(Duration::from_millis(100), TcpStream::connect(addr)).await {
            Ok(Ok(s)) => queued.push(s),
            _ => break,
        }
    }
    assert!(
        !queued.is_empty() && queued.len() < 64,
        "{} queued",
        queued.len()
    );
    let endpoint = format!("tcp://{addr}");
    let error = Sub::connect(&endpoint, b"", limits(), Duration::from_millis(200))
        .await
        .expect_err("no TCP connection");
    assert!(
        matches!(&error, Error::Io(e) if e.kind() == std::io::ErrorKind::TimedOut),
        "{error:?}"
    );
    assert_eq!(error.reject(), Reject::Disconnected);

    // Accepts, and never greets.
    let mute = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", mute.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = mute.accept().await {
            held.push(s);
        }
    });
    let error = Dealer::connect(&endpoint, limits(), CONNECT)
        .await
        .expect_err("no greeting");
    assert!(matches!(error, Error::HandshakeTimeout(_)), "{error:?}");
    assert_eq!(error.reject(), Reject::Timeout);
    drop(full);
}
