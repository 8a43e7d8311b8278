//! [`Faults::drop_after_chunks`]`: Some(n)` puts exactly `n` events of a stream on the
//! wire, then cuts the connection (no `[DONE]`, no clean end of the chunked body), on a
//! decode whose 200 head goes out before its KV is fetched as on any other stream: an
//! SGLang `/generate` decode (its head before its prefill was even asked), a vLLM NIXL
//! pull decode's chat stream and its `/v1/responses` stream, whose two opening events
//! go out with the head, before the pull (`n` below two included).
//!
//! The vLLM decodes' pulls are sent to a gate in place of their prefill's side channel:
//! the test holds the pull there until it read the head, then lets it through.

mod common;

use std::time::Duration;

use common::*;
use disagg_sim::{Faults, KvMode, SimConfig, SimEngine, SimRole};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};

const GENERATE: &str = "/generate";
const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const RESPONSES: &str = "/v1/responses";
const PROMPT: &str = "the quick brown fox jumps over the lazy dog";
/// How long a head may take before the test fails (a bound on a failure, not a wait
/// that orders anything: the head, when it comes, comes in milliseconds).
const HEAD_BOUND: Duration = Duration::from_secs(20);
/// The cuts tried: before the first event, after one (inside a Responses stream's two
/// opening events), after three.
const CUTS: [usize; 3] = [0, 1, 3];

fn dropping_after(n: usize) -> Faults {
    Faults {
        drop_after_chunks: Some(n),
        ..Faults::default()
    }
}

async fn engine(kv_mode: KvMode) -> SimEngine {
    SimEngine::start(SimConfig {
        kv_mode,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// Sends a request on `conn` and waits for its head, which must be a 200 event stream.
async fn stream_head(conn: &mut Conn, path: &str, body: &Value) -> http::Response<Incoming> {
    let sent = conn.send("POST", path, &[], Some(serde_json::to_vec(body).unwrap()));
    let head = tokio::time::timeout(HEAD_BOUND, sent)
        .await
        .expect("no response head");
    assert_eq!(head.status(), 200, "{:?}", head.headers());
    assert_eq!(
        head.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    head
}

/// Reads `body` to its end: its text, and whether it ended cleanly (`false`: cut off).
async fn read_to_end(body: Incoming) -> (String, bool) {
    let mut body = body;
    let mut text = String::new();
    loop {
        match body.frame().await {
            None => return (text, true),
            Some(Err(_)) => return (text, false),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    text.push_str(std::str::from_utf8(&data).unwrap());
                }
            }
        }
    }
}

/// Asserts that a stream was cut off after exactly `n` whole events, none `[DONE]`.
fn assert_cut_after(text: &str, clean: bool, n: usize, what: &str) {
    assert!(!clean, "{what}: the stream ended cleanly: {text:?}");
    assert!(
        text.is_empty() || text.ends_with("\n\n"),
        "{what}: an event cut in two: {text:?}"
    );
    assert_eq!(text.matches("\n\n").count(), n, "{what}: {text:?}");
    assert!(!text.contains("[DONE]"), "{what}: {text:?}");
}

/// An SGLang `/generate` decode gets its head before its prefill was asked (its fetch
/// waits in its body), and, cut after `n` events, streams exactly the first `n` answer
/// events of the answer its prefill's KV makes.
#[tokio::test]
async fn a_head_first_generate_decode_cut_after_n_events_streams_n() {
    let p = engine(KvMode::Sglang(SimRole::Prefill)).await;
    let d = engine(KvMode::Sglang(SimRole::Decode)).await;
    let port = p.bootstrap_addr().unwrap().port();
    for (room, n) in (1u64..).zip(CUTS) {
        d.set_faults(dropping_after(n));
        let body = json!({"text": PROMPT, "sampling_params": {"max_new_tokens": 8},
                          "stream": true, "bootstrap_host": "127.0.0.1",
                          "bootstrap_port": port, "bootstrap_room": room});
        let mut conn = Conn::open(d.addr()).await;
        let head = stream_head(&mut conn, GENERATE, &body).await;
        // The head came with no prefill asked yet: the decode has its KV from nobody.
        assert_eq!(d.stats().remote_decodes, room - 1, "cut after {n}");
        let (pr, (text, clean)) = tokio::join!(
            post(p.addr(), GENERATE, &body),
            read_to_end(head.into_body())
        );
        assert_eq!(pr.status, 200, "{}", pr.text());
        assert_cut_after(&text, clean, n, &format!("/generate cut after {n}"));
        // The answer's first `n` events, one token more each.
        for (k, event) in sse_events(&text).iter().enumerate() {
            assert_eq!(
                event["output_ids"].as_array().unwrap().len(),
                k + 1,
                "{event}"
            );
            assert_eq!(event["meta_info"]["finish_reason"], Value::Null, "{event}");
        }
        assert_eq!(d.stats().remote_decodes, room, "cut after {n}");
    }
}

/// Relays a gated connection to `to`, both ways, until either side closes.
fn let_through(mut gated: TcpStream, to: std::net::SocketAddr) {
    tokio::spawn(async move {
        let mut upstream = TcpStream::connect(to).await.unwrap();
        let _ = tokio::io::copy_bidirectional(&mut gated, &mut upstream).await;
    });
}

/// A vLLM NIXL pull decode cut after `n` events, sent `path` with `body(params)` whose
/// pull is held at a gate until its head came: the text it streamed and whether it
/// ended cleanly.
async fn gated_vllm_decode(
    n: usize,
    path: &str,
    body: fn(Value) -> Value,
    p: &SimEngine,
    d: &SimEngine,
) -> (String, bool) {
    d.set_faults(dropping_after(n));
    let leg = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 1,
                     "kv_transfer_params": {"do_remote_decode": true}});
    let reply = post(p.addr(), COMPLETIONS, &leg).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let mut params = reply.json()["kv_transfer_params"].clone();
    let gate = TcpListener::bind("127.0.0.1:0").await.unwrap();
    params["remote_port"] = json!(gate.local_addr().unwrap().port());
    let body = body(params);
    let mut conn = Conn::open(d.addr()).await;
    let (accepted, head) = tokio::join!(gate.accept(), stream_head(&mut conn, path, &body));
    // The head came while the pull waits at the gate.
    assert_eq!(d.stats().kv_pull_failures, 0);
    let_through(accepted.unwrap().0, p.side_channel_addr());
    read_to_end(head.into_body()).await
}

fn chat_body(params: Value) -> Value {
    json!({"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}],
           "max_tokens": 8, "stream": true, "kv_transfer_params": params})
}

fn responses_body(params: Value) -> Value {
    json!({"model": "sim-model", "input": PROMPT, "max_output_tokens": 8, "stream": true,
           "kv_transfer_params": params})
}

/// A vLLM chat decode whose head went out before its pull, cut after `n` events,
/// streams exactly `n` (its role chunk first).
#[tokio::test]
async fn a_head_first_chat_decode_cut_after_n_events_streams_n() {
    let (p, d) = pair().await;
    for n in CUTS {
        let (text, clean) = gated_vllm_decode(n, CHAT, chat_body, &p, &d).await;
        assert_cut_after(&text, clean, n, &format!("chat cut after {n}"));
        if n > 0 {
            let role = &sse_events(&text)[0];
            assert_eq!(role["choices"][0]["delta"]["role"], "assistant", "{role}");
        }
    }
}

/// A vLLM `/v1/responses` decode whose head went out before its pull, cut after `n`
/// events, streams exactly `n`, fewer than its two opening events included: the
/// opening sent with the head stops where the cut is.
#[tokio::test]
async fn a_head_first_responses_decode_cut_after_n_events_streams_n() {
    let (p, d) = pair().await;
    for n in CUTS {
        let (text, clean) = gated_vllm_decode(n, RESPONSES, responses_body, &p, &d).await;
        assert_cut_after(&text, clean, n, &format!("responses cut after {n}"));
        let names: Vec<&str> = text
            .split("\n\n")
            .filter_map(|frame| frame.strip_prefix("event: "))
            .filter_map(|frame| frame.split('\n').next())
            .collect();
        let opening = ["response.created", "response.in_progress"];
        assert_eq!(names[..n.min(2)], opening[..n.min(2)], "{text}");
    }
}
