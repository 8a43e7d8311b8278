//! The subscriber against libzmq publishers (pyzmq, as vLLM and SGLang publish), over
//! loopback TCP on ephemeral ports: real KV events and load reports are indexed, and a
//! 24 MB batch is refused at the 8 MiB ceiling with the process's memory bounded.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use disagg_kvevents::subscriber::{Malformed, SocketKind};
use disagg_kvevents::{EngineEndpoint, IndexConfig, KvIndex, Subscriber, SubscriberConfig};
use rmpv::Value;

fn python() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("DISAGG_PYTHON") {
        return p.into();
    }
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    assert!(
        venv.exists(),
        "no Python with pyzmq: run scripts/test.sh, or set DISAGG_PYTHON"
    );
    venv
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn peak() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libzmq_publishers_are_indexed_and_a_24_mb_batch_is_refused() {
    let tokens: Vec<Value> = (1..=16u64).map(Value::from).collect();
    let batch = encode(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![Value::Map(vec![
            ("type".into(), "BlockStored".into()),
            (
                "block_hashes".into(),
                Value::Array(vec![Value::from(0xF000_0000_0000_0001u64)]),
            ),
            ("parent_block_hash".into(), Value::Nil),
            ("token_ids".into(), Value::Array(tokens)),
            ("block_size".into(), 16.into()),
            ("medium".into(), "GPU".into()),
        ])]),
        0.into(),
    ]));
    let load = encode(&Value::Array(vec![
        "LoadStat".into(),
        2.into(),
        3.into(),
        100.into(),
        1000.into(),
        Value::Nil,
        777.into(),
    ]));
    // The PUBs publish every 20 ms; once the subscriber subscribed to its events (an
    // `XPUB`, a `PUB` that hears subscriptions: a `PUB` drops what it sends before),
    // the events socket sends one 24 MB batch `[1.0, [0] * 24M]`, then good batches
    // again.
    let script = r#"
import struct, sys, time, zmq
batch, load = bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2])
huge = b"\x92\xcb" + struct.pack(">d", 1.0) + b"\xdd" + struct.pack(">I", 24_000_000) + bytes(24_000_000)
ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB); ep = pub.bind_to_random_port("tcp://127.0.0.1")
lpub = ctx.socket(zmq.PUB); lp = lpub.bind_to_random_port("tcp://127.0.0.1")
print(ep, lp, flush=True)
seq, start, subscribed, sent_huge = 0, time.time(), False, False
while time.time() - start < 30:
    while not subscribed and pub.poll(0):
        subscribed = pub.recv().startswith(b"\x01")
    if subscribed and not sent_huge:
        pub.send_multipart([b"", struct.pack(">Q", seq), huge]); seq += 1; sent_huge = True
    pub.send_multipart([b"", struct.pack(">Q", seq), batch]); seq += 1
    lpub.send_multipart([b"load", struct.pack(">Q", seq), load])
    time.sleep(0.02)
"#;
    let mut child = Command::new(python())
        .args(["-c", script, &hex(&batch), &hex(&load)])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let ports: Vec<&str> = line.split_whitespace().collect();
    let engine = "http://engine:8000";
    let endpoint = EngineEndpoint::new(engine, format!("tcp://127.0.0.1:{}", ports[0]))
        .unwrap()
        .with_load(format!("tcp://127.0.0.1:{}", ports[1]))
        .unwrap();
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let subscriber = Subscriber::new(
        index.clone(),
        SubscriberConfig {
            connect_timeout: Duration::from_millis(200),
            ..SubscriberConfig::default()
        },
    );
    subscriber.set_endpoints(vec![endpoint]).await;
    let prompt: Vec<u32> = (1..=17).collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    let oversized = |s: &Subscriber| {
        s.status()[0]
            .malformed
            .get(&(SocketKind::Events, Malformed::Oversized))
            .copied()
            .unwrap_or(0)
    };
    loop {
        let indexed = index.cached_tokens(engine, &prompt) == 16;
        let loaded = index
            .loads()
            .get(engine, 0, Instant::now(), Duration::from_secs(5))
            .is_some_and(|l| l.waiting_uncached_tokens == 777);
        let refused = oversized(&subscriber) >= 1;
        let after = subscriber.status()[0].connected && subscriber.status()[0].batches > 0;
        if indexed && loaded && refused && after {
            break;
        }
        assert!(Instant::now() < deadline, "{:?}", subscriber.status());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The process never held the 24 MB batch, let alone its ~950 MiB of rmpv values.
    assert!(peak() < 160 << 20, "peak {} MiB", peak() >> 20);
    let _ = child.kill();
    let _ = child.wait();
}
