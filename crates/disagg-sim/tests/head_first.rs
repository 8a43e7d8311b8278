//! A streamed vLLM decode that takes remote KV sends its 200 head before the KV is
//! loaded, as vLLM 0.33 does: Starlette's `StreamingResponse` writes the head as soon
//! as the stream generator is returned, before the engine tried the load. The load's
//! wait, its outcome (the answer, or the failure's stream of `kv_load_failure.rs`) and
//! a client that leaves meanwhile are the body's.
//!
//! The decode is sent to a gate in place of its prefill's side channel: the test holds
//! the decode's connection there until it read the head, then lets it through to the
//! prefill, closes it, or lets the client leave.

mod common;

use std::time::Duration;

use common::*;
use disagg_sim::{KvMode, SideChannelRelease, SideChannelRequest, SimConfig, SimEngine, SimRole};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const PROMPT: &str = "the quick brown fox jumps over the lazy dog and then some more words follow \
    so that the prompt spans several blocks of sixteen tokens each which is what we want here \
    to test block lists";
/// How long a head may take before the test fails (a bound on a failure, not a wait
/// that orders anything: the head, when it comes, comes in milliseconds).
const HEAD_BOUND: Duration = Duration::from_secs(20);

/// Sends the prefill leg (with `headers`) and returns its `kv_transfer_params`.
async fn prefill(p: &SimEngine, headers: &[(&str, &str)], path: &str, body: Value) -> Value {
    let reply = post_with(p.addr(), path, headers, &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()["kv_transfer_params"].clone()
}

fn chat_body(params: Value) -> Value {
    json!({"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}],
           "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true},
           "kv_transfer_params": params})
}

/// Sends a request and waits for its head.
async fn send_for_head(
    conn: &mut Conn,
    path: &str,
    headers: &[(&str, &str)],
    body: Value,
) -> http::Response<hyper::body::Incoming> {
    let sent = conn.send(
        "POST",
        path,
        headers,
        Some(serde_json::to_vec(&body).unwrap()),
    );
    tokio::time::timeout(HEAD_BOUND, sent)
        .await
        .expect("no response head")
}

/// Asserts a streamed answer's head.
fn assert_stream_head(head: &http::Response<hyper::body::Incoming>) {
    assert_eq!(head.status(), 200, "{:?}", head.headers());
    assert_eq!(
        head.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
}

/// A stream's events without their `created` (a clock's second).
fn without_created(reply: &Reply) -> Vec<Value> {
    let mut events = reply.events();
    for e in &mut events {
        if let Some(o) = e.as_object_mut() {
            o.remove("created");
        }
    }
    events
}

/// `d`'s counts once it has no request left: remote decodes, local prefills, failed
/// pulls, cancelled requests, release notices sent.
async fn counted_out(d: &SimEngine) -> [u64; 5] {
    let s = wait_for(d, |s| s.active_requests == 0).await;
    [
        s.remote_decodes,
        s.local_prefills,
        s.kv_pull_failures,
        s.cancelled,
        s.kv_releases_sent,
    ]
}

/// Relays a gated connection to `to`, both ways, until either side closes.
fn let_through(mut gated: TcpStream, to: std::net::SocketAddr) {
    tokio::spawn(async move {
        let mut upstream = TcpStream::connect(to).await.unwrap();
        let _ = tokio::io::copy_bidirectional(&mut gated, &mut upstream).await;
    });
}

/// The handoff of a NIXL pull prefill leg `p` answered, its side channel replaced by a
/// gate the test holds (returned with it).
async fn gated_handoff(p: &SimEngine) -> (Value, TcpListener) {
    let leg = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 1,
                     "kv_transfer_params": {"do_remote_decode": true}});
    let mut params = prefill(p, &[], COMPLETIONS, leg).await;
    let gate = TcpListener::bind("127.0.0.1:0").await.unwrap();
    params["remote_port"] = json!(gate.local_addr().unwrap().port());
    (params, gate)
}

/// A streamed chat's decode whose pull is sent to a gate in place of `p`'s side
/// channel: the gate (which later connections to the side channel reach too), the
/// gated pull's connection, the head, and the client's connection (kept open).
async fn gated_pull(
    p: &SimEngine,
    d: &SimEngine,
) -> (
    TcpListener,
    TcpStream,
    http::Response<hyper::body::Incoming>,
    Conn,
) {
    let (params, gate) = gated_handoff(p).await;
    let mut conn = Conn::open(d.addr()).await;
    let (accepted, head) = tokio::join!(
        gate.accept(),
        send_for_head(&mut conn, CHAT, &[], chat_body(params))
    );
    (gate, accepted.unwrap().0, head, conn)
}

/// A NIXL pull decode gets its head while its pull waits at the gate; let through, the
/// pull completes and the stream is the one an ungated decode streams.
#[tokio::test]
async fn a_streamed_pull_decode_gets_its_head_while_its_pull_waits() {
    let (p, d) = pair().await;
    let leg = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 1,
                     "kv_transfer_params": {"do_remote_decode": true}});
    let mut gated = prefill(&p, &[], COMPLETIONS, leg.clone()).await;
    let direct = prefill(&p, &[], COMPLETIONS, leg).await;
    let gate = TcpListener::bind("127.0.0.1:0").await.unwrap();
    gated["remote_port"] = json!(gate.local_addr().unwrap().port());

    let headers = [("x-request-id", "decode-1")];
    let mut conn = Conn::open(d.addr()).await;
    let body = chat_body(gated);
    let (accepted, head) = tokio::join!(
        gate.accept(),
        send_for_head(&mut conn, CHAT, &headers, body.clone())
    );
    let (pull, _) = accepted.unwrap();
    // The head came while the pull is held at the gate: nothing pulled, nothing failed.
    assert_stream_head(&head);
    assert_eq!(head.headers()["x-request-id"], "decode-1");
    let s = d.stats();
    assert_eq!(
        (s.remote_decodes, s.kv_pull_failures, s.active_requests),
        (0, 0, 1)
    );
    assert_eq!(p.stats().blocks_held, 6);

    let_through(pull, p.side_channel_addr());
    let gated = read(head).await;
    let direct = post_with(d.addr(), CHAT, &headers, &chat_body(direct)).await;
    assert_eq!(direct.status, 200, "{}", direct.text());
    assert_eq!(without_created(&gated), without_created(&direct));
    let content: String = gated
        .events()
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, disagg_sim::generate(PROMPT, 5, 0).concat());
    assert_eq!(counted_out(&d).await, [2, 0, 0, 0, 0]);
    assert_eq!(p.stats().blocks_held, 0);
}

/// A pull that fails after the head (the prefill's side closed without an answer)
/// ends the stream as a failed KV load does: the role chunk, the error event, `[DONE]`.
#[tokio::test]
async fn a_pull_that_fails_after_the_head_ends_the_stream_with_the_error_event() {
    let (p, d) = pair().await;
    let (_gate, accepted, head, _conn) = gated_pull(&p, &d).await;
    assert_stream_head(&head);
    assert_eq!(
        d.stats().kv_pull_failures,
        0,
        "the head came before the pull failed"
    );
    drop(accepted);
    let reply = read(head).await;
    let events = reply.events();
    assert_eq!(events.len(), 3, "{}", reply.text());
    assert_eq!(
        events[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let message = events[1]["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("KV transfer failed: "), "{message}");
    assert_eq!(events[1]["error"]["code"], 500);
    assert_eq!(events[2], "[DONE]");
    assert_eq!(counted_out(&d).await, [0, 0, 1, 0, 0]);
}

/// A streamed request to `path` (its body made of the prefill's handoff by `body`, its
/// `x-request-id` `request_id`) whose decode gets its head while its pull is held, then
/// sees the pull fail (the gate dropped): the answer's text, and the decode.
async fn failed_after_the_head(
    path: &str,
    request_id: &str,
    body: impl FnOnce(Value) -> Value,
) -> (String, SimEngine) {
    let (p, d) = pair().await;
    let (params, gate) = gated_handoff(&p).await;
    let headers = [("x-request-id", request_id)];
    let mut conn = Conn::open(d.addr()).await;
    let (accepted, head) = tokio::join!(
        gate.accept(),
        send_for_head(&mut conn, path, &headers, body(params))
    );
    let (pull, _) = accepted.unwrap();
    assert_stream_head(&head);
    assert_eq!(head.headers()["x-request-id"], request_id);
    assert_eq!(
        d.stats().kv_pull_failures,
        0,
        "the head came before the pull failed"
    );
    drop(pull);
    (read(head).await.text(), d)
}

/// A streamed `/v1/messages` decode gets its head while its pull waits, as chat's does
/// (vLLM's Anthropic route returns the chat stream generator under its converter);
/// the pull failing after it ends the stream as vLLM's converter ends it:
/// `message_start`, then the `error` event (500: `api_error`), nothing after.
#[tokio::test]
async fn a_messages_decode_whose_pull_fails_after_the_head_ends_with_the_error_event() {
    let (text, d) = failed_after_the_head("/v1/messages", "msg-1", |params| {
        json!({"model": "sim-model", "max_tokens": 5, "stream": true,
               "messages": [{"role": "user", "content": PROMPT}],
               "kv_transfer_params": params})
    })
    .await;
    let frames: Vec<&str> = text.split("\n\n").filter(|f| !f.is_empty()).collect();
    assert_eq!(frames.len(), 2, "{text}");
    assert!(
        frames[0].starts_with("event: message_start\ndata: "),
        "{text}"
    );
    let (name, data) = frames[1].split_once('\n').unwrap();
    assert_eq!(name, "event: error", "{text}");
    let error: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(error["type"], "error", "{error}");
    assert_eq!(error["error"]["type"], "api_error", "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("KV transfer failed: "), "{message}");
    assert_eq!(counted_out(&d).await, [0, 0, 1, 0, 0]);
}

/// A client that leaves after the head, while the pull waits: the pull is dropped (its
/// connection closed), the prefill told to free the blocks, and the request counted
/// out as cancelled.
#[tokio::test]
async fn a_client_leaving_while_the_pull_waits_drops_the_pull_and_counts_out() {
    let (p, d) = pair().await;
    let (gate, accepted, head, conn) = gated_pull(&p, &d).await;
    assert_stream_head(&head);
    let mut pull = accepted;
    assert_eq!(d.stats().active_requests, 1);
    drop(head);
    drop(conn);

    // The pull's connection: its request line, then its end.
    let mut sent = Vec::new();
    pull.read_to_end(&mut sent).await.unwrap();
    let line: SideChannelRequest = serde_json::from_slice(&sent).unwrap();
    assert_eq!(line.engine_id, "prefill-0");
    // Then the release notice, on a connection of its own, let through to the prefill.
    let (release, _) = gate.accept().await.unwrap();
    let mut release = BufReader::new(release);
    let mut notice = String::new();
    release.read_line(&mut notice).await.unwrap();
    let notice: SideChannelRelease = serde_json::from_str(&notice).unwrap();
    assert_eq!(notice.release, line);
    let mut upstream = TcpStream::connect(p.side_channel_addr()).await.unwrap();
    let mut release = release.into_inner();
    upstream
        .write_all(notice_line(&notice).as_bytes())
        .await
        .unwrap();
    let _ = tokio::io::copy_bidirectional(&mut release, &mut upstream).await;

    assert_eq!(counted_out(&d).await, [0, 0, 0, 1, 1]);
    let ps = wait_for(&p, |s| s.blocks_held == 0).await;
    assert_eq!(ps.kv_released_on_abort, 1);
}

/// A NIXL push prefill and decode, and a streamed decode leg (request id `req-1`) sent
/// with the prefill's handoff, its registration held at a gate in place of the
/// prefill's side channel: the prefill, the decode, the gate (which later connections
/// to the side channel reach too), the gated registration's connection, the decode's
/// head and the client's connection (kept open).
async fn gated_push() -> (
    SimEngine,
    SimEngine,
    TcpListener,
    TcpStream,
    http::Response<hyper::body::Incoming>,
    Conn,
) {
    let engine = |id: &str| SimConfig {
        kv_mode: KvMode::NixlPush,
        engine_id: Some(id.into()),
        ..SimConfig::default()
    };
    let p = SimEngine::start(engine("prefill-0")).await.unwrap();
    let d = SimEngine::start(engine("decode-0")).await.unwrap();
    let headers = [("x-request-id", "req-1")];
    let leg = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 1,
                     "kv_transfer_params": {"do_remote_decode": true}});
    let mut params = prefill(&p, &headers, COMPLETIONS, leg).await;
    let gate = TcpListener::bind("127.0.0.1:0").await.unwrap();
    params["remote_port"] = json!(gate.local_addr().unwrap().port());
    let body = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 5,
                      "stream": true, "kv_transfer_params": params});
    let mut conn = Conn::open(d.addr()).await;
    let (accepted, head) = tokio::join!(
        gate.accept(),
        send_for_head(&mut conn, COMPLETIONS, &headers, body)
    );
    (p, d, gate, accepted.unwrap().0, head, conn)
}

fn notice_line(notice: &SideChannelRelease) -> String {
    let mut line = serde_json::to_string(notice).unwrap();
    line.push('\n');
    line
}

/// A NIXL push decode gets its head while its registration waits at the gate; let
/// through, the prefill pairs it and the stream is the answer.
#[tokio::test]
async fn a_streamed_push_decode_gets_its_head_while_its_registration_waits() {
    let (p, d, _gate, registration, head, _conn) = gated_push().await;
    assert_stream_head(&head);
    assert_eq!((d.stats().remote_decodes, p.stats().blocks_held), (0, 3));
    let_through(registration, p.side_channel_addr());
    let reply = read(head).await;
    let events = reply.events();
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, disagg_sim::generate(PROMPT, 5, 0).concat());
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert_eq!(counted_out(&d).await, [1, 0, 0, 0, 0]);
    assert_eq!(p.stats().blocks_held, 0);
}

/// A Mooncake decode asked for remote KV it cannot name ("Got invalid
/// KVTransferParams") waits for KV nobody sends: streamed, after its head, until the
/// client leaves; it is then counted out.
#[tokio::test]
async fn a_stuck_streamed_mooncake_decode_sends_its_head_and_waits_until_the_client_leaves() {
    let d = SimEngine::start(SimConfig {
        kv_mode: KvMode::Mooncake(SimRole::Decode),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let body = chat_body(json!({"do_remote_prefill": true, "do_remote_decode": false,
                                "transfer_id": "t"}));
    let mut conn = Conn::open(d.addr()).await;
    let head = send_for_head(&mut conn, CHAT, &[], body).await;
    assert_stream_head(&head);
    let s = wait_for(&d, |s| s.stuck_kv_waits == 1).await;
    assert_eq!(s.active_requests, 1);
    drop(head);
    drop(conn);
    assert_eq!(counted_out(&d).await, [0, 0, 0, 1, 0]);
}

/// Not streamed, vLLM answers at the end: a decode whose pull fails gets its 500 head
/// only then.
#[tokio::test]
async fn a_pull_decode_not_streamed_answers_its_failure_in_the_head() {
    let (p, d) = pair().await;
    let (params, gate) = gated_handoff(&p).await;
    let mut body = chat_body(params);
    body["stream"] = json!(false);
    body.as_object_mut().unwrap().remove("stream_options");
    let mut conn = Conn::open(d.addr()).await;
    let head = conn.send("POST", CHAT, &[], Some(serde_json::to_vec(&body).unwrap()));
    // The pull held at the gate, then refused: only then does the head come, a 500.
    let refused = async {
        drop(gate.accept().await.unwrap());
    };
    let (head, ()) = tokio::join!(head, refused);
    let reply = read(head).await;
    assert_transfer_failed(&reply, "");
}

/// A streamed completions request with `"max_tokens": null` gets the same head with
/// remote KV (a pull decode: the head goes out before the pull) and without (a plain
/// request): 200, an event stream, and its `X-Request-Id` echoed as every other
/// answer of the simulator echoes it; then the null limit's error event and `[DONE]`.
#[tokio::test]
async fn a_null_max_tokens_stream_has_the_same_head_with_remote_kv_or_without() {
    let (p, d) = pair().await;
    let leg = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 1,
                     "kv_transfer_params": {"do_remote_decode": true}});
    let params = prefill(&p, &[], COMPLETIONS, leg).await;
    let body = |params: Option<Value>| {
        let mut body = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": null,
                              "stream": true});
        if let Some(params) = params {
            body["kv_transfer_params"] = params;
        }
        body
    };
    let remote = post_with(
        d.addr(),
        COMPLETIONS,
        &[("x-request-id", "r-1")],
        &body(Some(params)),
    )
    .await;
    let plain = post_with(
        d.addr(),
        COMPLETIONS,
        &[("x-request-id", "r-2")],
        &body(None),
    )
    .await;
    for (reply, id) in [(&remote, "r-1"), (&plain, "r-2")] {
        assert_eq!(reply.status, 200, "{id}: {}", reply.text());
        assert_eq!(
            reply.headers["content-type"], "text/event-stream; charset=utf-8",
            "{id}"
        );
        assert_eq!(
            reply
                .headers
                .get("x-request-id")
                .map(|v| v.to_str().unwrap()),
            Some(id),
            "{id}: {:?}",
            reply.headers
        );
        let events = reply.events();
        assert_eq!(events.len(), 2, "{id}: {}", reply.text());
        assert_eq!(events[0]["error"]["message"], "max_tokens must not be None");
        assert_eq!(events[1], "[DONE]");
    }
    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!((s.remote_decodes, s.local_prefills), (1, 1));
}

/// A Mooncake decode gets its head while its fetch waits: its bootstrap query is held
/// at a gate in place of the prefill's bootstrap server. Let through, the decode pulls
/// the transfer and streams the answer.
#[tokio::test]
async fn a_streamed_mooncake_decode_gets_its_head_while_its_fetch_waits() {
    let engine = |role, id: &str| SimConfig {
        kv_mode: KvMode::Mooncake(role),
        engine_id: Some(id.into()),
        ..SimConfig::default()
    };
    let p = SimEngine::start(engine(SimRole::Prefill, "prefill-0"))
        .await
        .unwrap();
    let d = SimEngine::start(engine(SimRole::Decode, "decode-0"))
        .await
        .unwrap();
    let messages = json!([{"role": "user", "content": PROMPT}]);
    let leg = json!({"model": "sim-model", "messages": messages, "max_tokens": 1,
                     "kv_transfer_params": {"do_remote_decode": true,
                                            "do_remote_prefill": false,
                                            "transfer_id": "t-1"}});
    prefill(&p, &[], CHAT, leg).await;
    assert_eq!(p.stats().kv_transfers_pending, 1);
    let gate = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let body = chat_body(json!({"do_remote_prefill": true, "do_remote_decode": false,
                                "remote_bootstrap_addr":
                                    format!("http://{}", gate.local_addr().unwrap()),
                                "remote_engine_id": "prefill-0", "transfer_id": "t-1"}));

    let mut conn = Conn::open(d.addr()).await;
    let (accepted, head) = tokio::join!(
        gate.accept(),
        send_for_head(&mut conn, CHAT, &[("x-request-id", "mc-1")], body)
    );
    // The head came while the query is held at the gate: nothing fetched yet.
    assert_stream_head(&head);
    assert_eq!(head.headers()["x-request-id"], "mc-1");
    let s = d.stats();
    assert_eq!(
        (s.remote_decodes, s.kv_pull_failures, s.active_requests),
        (0, 0, 1)
    );
    assert_eq!(p.stats().kv_transfers_pending, 1);

    let_through(accepted.unwrap().0, p.bootstrap_addr().unwrap());
    let reply = read(head).await;
    let events = reply.events();
    let content: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, disagg_sim::generate(PROMPT, 5, 0).concat());
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert!(
        events.iter().all(|e| e.get("error").is_none()),
        "{events:?}"
    );
    assert_eq!(counted_out(&d).await, [1, 0, 0, 0, 0]);
    assert_eq!(p.stats().kv_transfers_pending, 0);
}

/// A NIXL push decode whose client leaves after the head, while its registration waits
/// at the gate: the registration is dropped (its connection closed), the prefill told
/// to free the blocks its answer named, and the request counted out as cancelled.
#[tokio::test]
async fn a_client_leaving_while_a_push_decode_waits_drops_the_registration_and_counts_out() {
    let (p, d, gate, mut registration, head, conn) = gated_push().await;
    assert_eq!(p.stats().blocks_held, 3);
    assert_stream_head(&head);
    assert_eq!(d.stats().active_requests, 1);
    drop(head);
    drop(conn);

    // The registration's connection: its line, then its end.
    let mut sent = Vec::new();
    registration.read_to_end(&mut sent).await.unwrap();
    let line: Value = serde_json::from_slice(&sent).unwrap();
    assert_eq!(line["register"]["engine_id"], "prefill-0", "{line}");
    // Then the release notice, on a connection of its own, let through to the prefill.
    let (release, _) = gate.accept().await.unwrap();
    let_through(release, p.side_channel_addr());

    assert_eq!(counted_out(&d).await, [0, 0, 0, 1, 1]);
    let ps = wait_for(&p, |s| s.blocks_held == 0).await;
    assert_eq!(ps.kv_released_on_abort, 1);
}

/// A streamed decode refused before vLLM returns its generator is still refused in its
/// head, with no 200 first: a bad field (400), and, answered before the head here
/// (vLLM's engine core dies after it), a NIXL decode whose `remote_block_ids` name no
/// block and a NIXL push decode without `tp_size` (500, the engine core dead).
#[tokio::test]
async fn a_streamed_decode_refused_before_its_work_is_refused_in_its_head() {
    let (p, d) = pair().await;
    let leg = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 1,
                     "kv_transfer_params": {"do_remote_decode": true}});
    let params = prefill(&p, &[], COMPLETIONS, leg).await;
    let refused_head = |engine: &SimEngine, body: Value| {
        let addr = engine.addr();
        async move {
            let mut conn = Conn::open(addr).await;
            let head = send_for_head(&mut conn, CHAT, &[("x-request-id", "bad-1")], body).await;
            let reply = read(head).await;
            assert_eq!(reply.headers["content-type"], "application/json");
            assert_eq!(reply.headers["x-request-id"], "bad-1");
            reply
        }
    };

    // A bad field: refused before any work, the pull never tried.
    let mut bad = chat_body(params.clone());
    bad["stream_options"] = json!("usage please");
    let reply = refused_head(&d, bad).await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    assert!(
        error_message(&reply).contains("stream_options"),
        "{}",
        reply.text()
    );
    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!((s.kv_pull_failures, s.remote_decodes), (0, 0));
    assert_eq!(p.stats().blocks_held, 3);

    // NIXL pull: block ids that name no block.
    let mut empty = params;
    empty["remote_block_ids"] = json!([]);
    let reply = refused_head(&d, chat_body(empty)).await;
    assert_eq!(reply.status, 500, "{}", reply.text());
    let s = wait_for(&d, |s| s.active_requests == 0).await;
    assert_eq!((s.engine_core_deaths, s.kv_pull_failures), (1, 0));

    // NIXL push: a key its scheduler indexes is missing.
    let push = SimEngine::start(SimConfig {
        kv_mode: KvMode::NixlPush,
        engine_id: Some("decode-1".into()),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let missing = json!({"do_remote_prefill": true, "do_remote_decode": false,
                         "remote_engine_id": "prefill-0", "remote_host": "127.0.0.1",
                         "remote_port": p.side_channel_addr().port()});
    let reply = refused_head(&push, chat_body(missing)).await;
    assert_eq!(reply.status, 500, "{}", reply.text());
    let s = wait_for(&push, |s| s.active_requests == 0).await;
    assert_eq!((s.engine_core_deaths, s.kv_pull_failures), (1, 0));
}

const COHERE: &str = "/cohere/v2/chat";
const RESPONSES: &str = "/v1/responses";

fn cohere_body(params: Value) -> Value {
    json!({"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}],
           "max_tokens": 5, "stream": true, "kv_transfer_params": params})
}

fn responses_body(params: Value) -> Value {
    json!({"model": "sim-model", "input": PROMPT, "max_output_tokens": 5, "stream": true,
           "kv_transfer_params": params})
}

/// A stream's frames (the text between blank lines).
fn frames(text: &str) -> Vec<&str> {
    text.split("\n\n").filter(|f| !f.is_empty()).collect()
}

/// The `event:` name and `data:` payload of each frame of a Responses stream, without
/// the response's `created_at` (a clock's second), which `created_at` returns.
fn responses_events(text: &str) -> (Vec<(String, Value)>, Vec<Value>) {
    assert!(text.ends_with("\n\n"), "{text:?}");
    let mut created = Vec::new();
    let events = frames(text)
        .into_iter()
        .map(|frame| {
            let (name, data) = frame.split_once('\n').unwrap();
            let name = name.strip_prefix("event: ").unwrap();
            let mut data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap())
                .unwrap_or_else(|e| panic!("{e}: {frame:?}"));
            assert_eq!(data["type"], name, "{frame}");
            if let Some(response) = data.get_mut("response").and_then(Value::as_object_mut) {
                created.extend(response.remove("created_at"));
            }
            (name.to_owned(), data)
        })
        .collect();
    (events, created)
}

/// Reads `body` until `n` whole events came and returns their text.
async fn read_events(body: &mut hyper::body::Incoming, n: usize) -> String {
    use http_body_util::BodyExt;
    let mut text = String::new();
    while text.matches("\n\n").count() < n {
        let frame = tokio::time::timeout(HEAD_BOUND, body.frame())
            .await
            .unwrap_or_else(|_| panic!("no event after {text:?}"))
            .unwrap_or_else(|| panic!("the body ended after {text:?}"))
            .unwrap_or_else(|e| panic!("the body failed ({e}) after {text:?}"));
        if let Ok(data) = frame.into_data() {
            text.push_str(std::str::from_utf8(&data).unwrap());
        }
    }
    text
}

/// Reads the rest of `body`: its text, and how it ended (`Err`: cut off).
async fn read_rest(body: &mut hyper::body::Incoming) -> (String, Result<(), hyper::Error>) {
    use http_body_util::BodyExt;
    let mut text = String::new();
    loop {
        match body.frame().await {
            None => return (text, Ok(())),
            Some(Err(e)) => return (text, Err(e)),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    text.push_str(std::str::from_utf8(&data).unwrap());
                }
            }
        }
    }
}

/// A streamed `/cohere/v2/chat` decode gets its head while its pull waits (vLLM's Cohere
/// route returns the chat stream generator under its converter); the pull failing after
/// it ends the stream as vLLM 0.33's `_chat_completion_stream_to_v2` does: the role chunk
/// made `message-start` (pydantic's `model_dump_json(exclude_none=True)` of the SDK event,
/// its `type` declared last), the chat generator's error payload then failed the
/// converter's validation and its `except` wrote `message-end` with `json.dumps`, then
/// `[DONE]`.
#[tokio::test]
async fn a_cohere_decode_whose_pull_fails_after_the_head_ends_with_an_error_message_end() {
    let (text, d) = failed_after_the_head(COHERE, "co-1", cohere_body).await;
    let frames = frames(&text);
    assert_eq!(frames.len(), 3, "{text}");
    assert_eq!(
        frames[0],
        r#"data: {"id":"chatcmpl-co-1","delta":{"message":{"role":"assistant"}},"type":"message-start"}"#
    );
    let end = frames[1].strip_prefix("data: ").unwrap();
    assert!(
        end.starts_with(r#"{"type": "message-end", "delta": {"error": ""#)
            && end.ends_with(r#"", "finish_reason": "ERROR"}}"#),
        "{end}"
    );
    let end: Value = serde_json::from_str(end).unwrap();
    let message = end["delta"]["error"].as_str().unwrap();
    assert!(message.starts_with("KV transfer failed: "), "{message}");
    assert_eq!(frames[2], "data: [DONE]");
    assert_eq!(counted_out(&d).await, [0, 0, 1, 0, 0]);
}

/// A streamed `/v1/responses` decode gets its head, then `response.created` and
/// `response.in_progress`, while its pull waits: vLLM 0.33's `responses_stream_generator`
/// yields both before the engine's first output. The pull failing then cuts the
/// connection off, the body unfinished: the generator's `GenerationError` handler
/// validates the error payload against its event union, which has no member for it, and
/// the `ValidationError` leaves Starlette's stream after the head (uvicorn closes the
/// connection).
#[tokio::test]
async fn a_responses_decode_whose_pull_fails_after_its_opening_events_is_cut_off() {
    let (p, d) = pair().await;
    let (params, gate) = gated_handoff(&p).await;
    let headers = [("x-request-id", "resp-1")];
    let mut conn = Conn::open(d.addr()).await;
    let (accepted, head) = tokio::join!(
        gate.accept(),
        send_for_head(&mut conn, RESPONSES, &headers, responses_body(params))
    );
    let (pull, _) = accepted.unwrap();
    assert_stream_head(&head);
    assert_eq!(head.headers()["x-request-id"], "resp-1");
    let mut body = head.into_body();
    let opening = read_events(&mut body, 2).await;
    assert_eq!(
        d.stats().kv_pull_failures,
        0,
        "the opening events came before the pull failed"
    );
    let (events, created) = responses_events(&opening);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["response.created", "response.in_progress"]);
    for (seq, (_, event)) in events.iter().enumerate() {
        assert_eq!(event["sequence_number"], seq, "{event}");
        let response = &event["response"];
        assert_eq!(response["id"], "resp_resp-1", "{event}");
        assert_eq!(response["status"], "in_progress", "{event}");
        assert_eq!(response["output"], json!([]), "{event}");
        assert_eq!(response["usage"], Value::Null, "{event}");
        assert_eq!(response["max_output_tokens"], 5, "{event}");
    }
    assert_eq!(created[0], created[1]);

    drop(pull);
    let (rest, end) = read_rest(&mut body).await;
    assert_eq!(rest, "", "nothing follows the opening events");
    assert!(end.is_err(), "the body ended as if complete: {end:?}");
    assert_eq!(counted_out(&d).await, [0, 0, 1, 0, 0]);
}

/// Let through, a streamed Cohere decode's pull completes and its stream is the one an
/// ungated decode streams.
#[tokio::test]
async fn a_streamed_cohere_decode_gets_its_head_while_its_pull_waits() {
    let (p, d) = pair().await;
    let leg = json!({"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}],
                     "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    let mut gated = prefill(&p, &[], CHAT, leg.clone()).await;
    let direct = prefill(&p, &[], CHAT, leg).await;
    let gate = TcpListener::bind("127.0.0.1:0").await.unwrap();
    gated["remote_port"] = json!(gate.local_addr().unwrap().port());

    let headers = [("x-request-id", "co-2")];
    let mut conn = Conn::open(d.addr()).await;
    let (accepted, head) = tokio::join!(
        gate.accept(),
        send_for_head(&mut conn, COHERE, &headers, cohere_body(gated))
    );
    assert_stream_head(&head);
    assert_eq!(head.headers()["x-request-id"], "co-2");
    assert_eq!(d.stats().remote_decodes, 0, "the head came before the pull");

    let_through(accepted.unwrap().0, p.side_channel_addr());
    let gated = read(head).await;
    let direct = post_with(d.addr(), COHERE, &headers, &cohere_body(direct)).await;
    assert_eq!(direct.status, 200, "{}", direct.text());
    assert_eq!(gated.text(), direct.text());
    let events = gated.events();
    let content: String = events
        .iter()
        .filter_map(|e| e["delta"]["message"]["content"]["text"].as_str())
        .collect();
    assert_eq!(content, disagg_sim::generate(PROMPT, 5, 0).concat());
    assert_eq!(events[events.len() - 2]["type"], "message-end");
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert_eq!(counted_out(&d).await, [2, 0, 0, 0, 0]);
}

/// A streamed Responses decode gets its head and its two opening events while its pull
/// waits; let through, the rest follows, and the stream is the one an ungated decode
/// streams (one `created_at` throughout, as vLLM's one `created_time`).
#[tokio::test]
async fn a_streamed_responses_decode_sends_its_opening_events_while_its_pull_waits() {
    let (p, d) = pair().await;
    let (gated, gate) = gated_handoff(&p).await;
    let leg = json!({"model": "sim-model", "prompt": PROMPT, "max_tokens": 1,
                     "kv_transfer_params": {"do_remote_decode": true}});
    let direct = prefill(&p, &[], COMPLETIONS, leg).await;

    let headers = [("x-request-id", "resp-2")];
    let mut conn = Conn::open(d.addr()).await;
    let (accepted, head) = tokio::join!(
        gate.accept(),
        send_for_head(&mut conn, RESPONSES, &headers, responses_body(gated))
    );
    assert_stream_head(&head);
    let mut body = head.into_body();
    let opening = read_events(&mut body, 2).await;
    assert_eq!(
        d.stats().remote_decodes,
        0,
        "the events came before the pull"
    );

    let_through(accepted.unwrap().0, p.side_channel_addr());
    let (rest, end) = read_rest(&mut body).await;
    end.unwrap();
    let (gated, created) = responses_events(&(opening + &rest));
    assert!(created.windows(2).all(|w| w[0] == w[1]), "{created:?}");
    let direct = post_with(d.addr(), RESPONSES, &headers, &responses_body(direct)).await;
    assert_eq!(direct.status, 200, "{}", direct.text());
    let (direct, _) = responses_events(&direct.text());
    assert_eq!(gated, direct);
    let text: String = gated
        .iter()
        .filter(|(name, _)| name == "response.output_text.delta")
        .filter_map(|(_, e)| e["delta"].as_str())
        .collect();
    assert_eq!(text, disagg_sim::generate(PROMPT, 5, 0).concat());
    // Five tokens of five: `max_output_tokens` reached.
    assert_eq!(gated.last().unwrap().0, "response.incomplete");
    assert_eq!(counted_out(&d).await, [2, 0, 0, 0, 0]);
}

/// Not streamed, the Cohere and Responses routes answer a failed pull in the head, a
/// 500 in each route's error shape.
#[tokio::test]
async fn cohere_and_responses_decodes_not_streamed_answer_their_failure_in_the_head() {
    let (p, d) = pair().await;
    for (path, body) in [
        (COHERE, cohere_body as fn(Value) -> Value),
        (RESPONSES, responses_body),
    ] {
        let (params, gate) = gated_handoff(&p).await;
        let mut body = body(params);
        body["stream"] = json!(false);
        let mut conn = Conn::open(d.addr()).await;
        let head = conn.send("POST", path, &[], Some(serde_json::to_vec(&body).unwrap()));
        let refused = async {
            drop(gate.accept().await.unwrap());
        };
        let (head, ()) = tokio::join!(head, refused);
        let reply = read(head).await;
        assert_eq!(reply.status, 500, "{path}: {}", reply.text());
        let v = reply.json();
        let message = match path {
            COHERE => &v["message"],
            _ => &v["error"]["message"],
        };
        let message = message.as_str().unwrap_or_default();
        assert!(message.starts_with("KV transfer failed: "), "{path}: {v}");
    }
    assert_eq!(counted_out(&d).await, [0, 0, 2, 0, 0]);
}
