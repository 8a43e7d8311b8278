//! Engines' answers to a fanned-out admin request that cannot be listed whole: past the
//! 64 KiB kept of each (with a `content-length` saying so, or chunked and growing
//! past it), not JSON, cut off mid-body, stalled mid-body. Each engine's answer is read
//! to the ceiling and no further (the engine's writes are cut short, and the client has
//! its answer while the engine still holds most of a 100 MiB body); the client gets the
//! fan-out answer in OpenAI's format (502 `fan_out_failed`, naming the engine), each
//! engine's line in the documented shape, and the other engine's answer listed as it
//! came. Over loopback: a `PdService` served by the crate's server, raw engines behind.

#![allow(missing_docs)] // a test binary

use std::net::SocketAddr;
use std::time::Duration;

use disagg_connectors::vllm::VllmNixl;
use disagg_core::orchestrator::OrchestratorConfig;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::server::Builder;
use disagg_http::{HttpTransport, PdService, PdServiceConfig, RouteTable};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

mod common;
use common::read_message;

/// The most of one engine's answer the proxy keeps (`FAN_OUT_ANSWER_LIMIT`).
const CEILING: usize = 64 * 1024;

/// The body a huge answer would send: 100 MiB.
const HUGE: usize = 100 << 20;

/// How much of a huge answer is written before the engine waits for the client's
/// answer: well past the ceiling.
const BEFORE_WAIT: usize = 4 * CEILING;

/// How long a client waits for its answer before the test fails: the proxy must answer
/// on its own (a proxy that waited for a huge body's end never would, as the engine
/// sends the rest only once the client has its answer).
const ANSWER_WITHIN: Duration = Duration::from_secs(20);

/// The proxy's time for one engine's whole answer (`decode_head_timeout`) where an
/// answer stalls.
const ENGINE_TIMEOUT: Duration = Duration::from_millis(1000);

/// The proxy's time for one engine's whole answer elsewhere: longer than the client
/// waits, so that only the ceiling can end a huge answer in time.
const LONG_ENGINE_TIMEOUT: Duration = Duration::from_secs(300);

/// A well-formed engine answer, listed as it came.
const GOOD: &str = r#"{"status": "ok", "loaded": [1.50]}"#;

/// How a raw engine answers every request.
#[derive(Clone)]
enum Answer {
    /// `status`, this body with its `content-length`, of this type.
    Whole {
        status: u16,
        content_type: &'static str,
        body: Vec<u8>,
    },
    /// 200 and a 100 MiB body (its `content-length` says so, or chunked): written to
    /// [`BEFORE_WAIT`], then the rest once the client has its answer, until a write
    /// fails.
    Huge { chunked: bool },
    /// 200 and a head promising more than the few bytes sent (a `content-length` of
    /// 1000, or a chunked body without its last chunk); then the connection closed, or
    /// (`hold`) held open until the proxy closes it.
    Cut { chunked: bool, hold: bool },
}

/// What one engine connection saw of its answer's end.
#[derive(Debug)]
struct Report {
    /// The body's bytes written (chunk framing not counted).
    written: usize,
    /// Whether a write failed (the proxy closed the connection) before the body's end
    /// (always, for a [`Answer::Cut`], reported once the connection is closed).
    cut: bool,
}

/// A raw engine answering every request as `answer` says; a huge answer waits for
/// `answered` to count one more client answer than when the request came. Each
/// connection's [`Report`] is sent on the channel when its answer ends.
async fn raw_engine(
    answer: Answer,
    answered: watch::Receiver<u64>,
) -> (String, mpsc::UnboundedReceiver<Report>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let answer = answer.clone();
            let mut answered = answered.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                while read_message(&mut s).await.is_some() {
                    let seen = *answered.borrow_and_update();
                    match &answer {
                        Answer::Whole {
                            status,
                            content_type,
                            body,
                        } => {
                            let head = format!(
                                "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\n\
                                 content-length: {}\r\n\r\n",
                                body.len()
                            );
                            let out = [head.as_bytes(), body].concat();
                            if s.write_all(&out).await.is_err() {
                                return;
                            }
                        }
                        Answer::Huge { chunked } => {
                            let report = huge(&mut s, *chunked, &mut answered, seen).await;
                            let _ = tx.send(report);
                            return;
                        }
                        Answer::Cut { chunked, hold } => {
                            let framing = if *chunked {
                                "transfer-encoding: chunked\r\n\r\n7\r\n{\"ok\": \r\n"
                            } else {
                                "content-length: 1000\r\n\r\n{\"ok\": "
                            };
                            let out = format!(
                                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{framing}"
                            );
                            if s.write_all(out.as_bytes()).await.is_err() {
                                return;
                            }
                            if *hold {
                                // Held until the proxy closes it (read ends): only
                                // then reported.
                                let mut buf = [0u8; 1024];
                                while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                            }
                            let _ = tx.send(Report {
                                written: 7,
                                cut: true,
                            });
                            return;
                        }
                    }
                }
            });
        }
    });
    (url, rx)
}

/// A 200 with a 100 MiB body on `s`, written 16 KiB at a time: to [`BEFORE_WAIT`],
/// then (once `answered` has passed `seen`) the rest, until a write fails.
async fn huge(
    s: &mut TcpStream,
    chunked: bool,
    answered: &mut watch::Receiver<u64>,
    seen: u64,
) -> Report {
    let framing = if chunked {
        "transfer-encoding: chunked".to_owned()
    } else {
        format!("content-length: {HUGE}")
    };
    let head = format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{framing}\r\n\r\n");
    if s.write_all(head.as_bytes()).await.is_err() {
        return Report {
            written: 0,
            cut: true,
        };
    }
    const PIECE: usize = 16 * 1024;
    let piece = if chunked {
        [format!("{PIECE:x}\r\n").as_bytes(), &[b'7'; PIECE], b"\r\n"].concat()
    } else {
        vec![b'7'; PIECE]
    };
    let mut written = 0;
    let mut waited = false;
    while written < HUGE {
        if s.write_all(&piece).await.is_err() {
            return Report { written, cut: true };
        }
        written += PIECE;
        if !waited && written >= BEFORE_WAIT {
            waited = true;
            // The rest only once the client has its answer. A proxy that waited for the
            // body's end would never answer; the test ends (and this wait with it) when
            // the client's wait runs out.
            if answered.wait_for(|n| *n > seen).await.is_err() {
                return Report {
                    written,
                    cut: false,
                };
            }
        }
    }
    let cut = chunked && s.write_all(b"0\r\n\r\n").await.is_err();
    Report { written, cut }
}

/// A proxy with the admin routes open over a prefill and a decode engine, each engine
/// given `timeout` for its answer.
async fn proxy(prefill: &str, decode: &str, timeout: Duration) -> SocketAddr {
    let source = StaticSource::new([
        Endpoint::new(prefill, Role::Prefill).unwrap(),
        Endpoint::new(decode, Role::Decode).unwrap(),
    ]);
    let mut orchestrator_config = OrchestratorConfig::default();
    orchestrator_config.decode_head_timeout = timeout;
    let orchestrator = Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new())
        .config(orchestrator_config)
        .build();
    let mut config = PdServiceConfig::default();
    config.routes = RouteTable::default().admin_routes(true);
    let service = PdService::with_config(orchestrator, config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Builder::new().serve(listener, service, std::future::pending()));
    addr
}

/// The fanned-out requests sent: vLLM's LoRA load (a JSON body naming no model, so
/// every engine), its cache reset (no body) and sleep query (`GET`), a path under
/// vLLM's `/fault_tolerance/*`, SGLang's cache flush.
const REQUESTS: &[(&str, &str, &str)] = &[
    (
        "POST",
        "/v1/load_lora_adapter",
        r#"{"lora_name":"sql","lora_path":"/adapters/sql"}"#,
    ),
    ("POST", "/reset_prefix_cache", ""),
    ("GET", "/is_sleeping", ""),
    ("POST", "/fault_tolerance/apply", "{}"),
    ("POST", "/flush_cache", ""),
];

/// The client's answer: its status, its body parsed, its body's length.
struct Got {
    status: u16,
    json: Value,
    len: usize,
    text: String,
}

/// `method path` with `body`; the answer, within [`ANSWER_WITHIN`] (or the test fails:
/// the client was left waiting).
async fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Got {
    let exchange = async {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             connection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        tcp.read_to_end(&mut got).await.unwrap();
        got
    };
    let got = tokio::time::timeout(ANSWER_WITHIN, exchange)
        .await
        .unwrap_or_else(|_| panic!("{method} {path}: no answer within {ANSWER_WITHIN:?}"));
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {text}"));
    let at = text.find("\r\n\r\n").unwrap() + 4;
    let body = &text[at..];
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
    Got {
        status,
        json,
        len: body.len(),
        text: text.clone(),
    }
}

/// Asserts `got` is the 502 `fan_out_failed` answer for `path` in OpenAI's format,
/// naming `failed` and not the engine that answered, with the prefill's well-formed
/// answer listed as it came and the decode's line holding its status (200: its head
/// came) and `error` containing `why`, without its body.
fn assert_decode_failed(got: &Got, label: &str, failed: &str, answered: &str, why: &str) {
    let v = &got.json;
    let path = label.split(' ').next().unwrap();
    assert_eq!(got.status, 502, "{label}: {}", got.text);
    assert_eq!(v["error"]["type"], "server_error", "{label}: {v}");
    assert_eq!(v["error"]["code"], "fan_out_failed", "{label}: {v}");
    assert_eq!(v["error"]["param"], Value::Null, "{label}: {v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("1 of 2 engines failed"), "{message}");
    assert!(message.contains(failed), "{label}: {message}");
    // (Followed by what it did: one address may start another's, `:1234` and `:12345`.)
    assert!(
        !message.contains(&format!("{answered}:")) && !message.contains(&format!("{answered} ")),
        "{label}: {message}"
    );
    assert_eq!(v["object"], "fan_out", "{label}: {v}");
    assert_eq!(v["path"], path, "{label}: {v}");
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "{label}: {v}");
    assert_eq!(results[0]["endpoint"], answered, "{label}: {v}");
    assert_eq!(results[0]["role"], "prefill");
    assert_eq!(results[0]["status"], 200);
    assert!(
        got.text.contains(&format!(r#""body":{GOOD}"#)),
        "{label}: the good answer as it came: {}",
        got.text
    );
    assert!(results[0].get("error").is_none(), "{label}: {v}");
    assert_eq!(results[1]["endpoint"], failed, "{label}: {v}");
    assert_eq!(results[1]["role"], "decode");
    assert_eq!(results[1]["status"], 200, "{label}: its head came: {v}");
    assert!(results[1].get("body").is_none(), "{label}: {v}");
    let error = results[1]["error"].as_str().unwrap();
    assert!(error.contains(why), "{label}: {error}");
}

/// The `error` of an engine's line whose answer went past the ceiling: the ceiling in
/// bytes.
fn past_the_ceiling() -> String {
    format!("the answer is longer than {CEILING} bytes")
}

/// The start of the `error` of an engine's line whose answer was cut off mid-body,
/// followed by its cause.
const CUT_OFF: &str = "reading the answer: error reading a body from connection: ";

fn good() -> Answer {
    Answer::Whole {
        status: 200,
        content_type: "application/json",
        body: GOOD.as_bytes().to_vec(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_past_the_ceiling_is_cut_there_on_every_fanned_out_route() {
    for chunked in [false, true] {
        let (answered, watching) = watch::channel(0u64);
        let (p, _) = raw_engine(good(), watching.clone()).await;
        let (d, mut reports) = raw_engine(Answer::Huge { chunked }, watching).await;
        let addr = proxy(&p, &d, LONG_ENGINE_TIMEOUT).await;
        for (method, path, body) in REQUESTS {
            let got = request(addr, method, path, body).await;
            answered.send_modify(|n| *n += 1);
            let what = format!("{path} (chunked: {chunked})");
            assert_decode_failed(&got, &what, &d, &p, &past_the_ceiling());
            // The huge body is not in the answer: no more than the good one and the
            // message.
            assert!(got.len < 2048, "{what}: {} bytes", got.len);
            // The engine's writes were cut short: the proxy closed the connection once
            // past the ceiling, rather than reading (or draining) the rest.
            let report = tokio::time::timeout(ANSWER_WITHIN, reports.recv())
                .await
                .unwrap_or_else(|_| panic!("{what}: the engine's answer never ended"))
                .unwrap();
            assert!(report.cut, "{what}: {report:?}");
            assert!(report.written < HUGE, "{what}: {report:?}");
            assert!(report.written >= CEILING, "{what}: {report:?}");
        }
    }
}

/// Both engines past the ceiling: both named, neither listed with a body; 502 (not the
/// engines' 200).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_engine_past_the_ceiling_is_a_502_naming_each() {
    let (answered, watching) = watch::channel(0u64);
    let (p, mut p_reports) = raw_engine(Answer::Huge { chunked: false }, watching.clone()).await;
    let (d, mut d_reports) = raw_engine(Answer::Huge { chunked: true }, watching).await;
    let addr = proxy(&p, &d, LONG_ENGINE_TIMEOUT).await;
    let (method, path, body) = REQUESTS[0];
    let got = request(addr, method, path, body).await;
    answered.send_modify(|n| *n += 1);
    assert_eq!(got.status, 502, "{}", got.text);
    assert_eq!(got.json["error"]["code"], "fan_out_failed");
    let message = got.json["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("2 of 2 engines failed"), "{message}");
    assert!(message.contains(&p) && message.contains(&d), "{message}");
    for r in got.json["results"].as_array().unwrap() {
        assert_eq!(r["status"], 200, "{r}");
        assert!(r.get("body").is_none(), "{r}");
        assert_eq!(r["error"], past_the_ceiling(), "{r}");
    }
    for reports in [&mut p_reports, &mut d_reports] {
        let report = tokio::time::timeout(ANSWER_WITHIN, reports.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(report.cut && report.written < HUGE, "{report:?}");
    }
}

/// An answer of exactly the ceiling is listed whole; one byte more is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_of_exactly_the_ceiling_is_listed_and_one_byte_more_is_not() {
    let (_answered, watching) = watch::channel(0u64);
    let (p, _) = raw_engine(good(), watching.clone()).await;
    let string = |len: usize| format!("\"{}\"", "a".repeat(len - 2)).into_bytes();
    let at = Answer::Whole {
        status: 200,
        content_type: "application/json",
        body: string(CEILING),
    };
    let (d, _) = raw_engine(at, watching.clone()).await;
    let addr = proxy(&p, &d, LONG_ENGINE_TIMEOUT).await;
    let (method, path, body) = REQUESTS[0];
    let got = request(addr, method, path, body).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(
        got.json["results"][1]["body"].as_str().unwrap().len(),
        CEILING - 2
    );

    let over = Answer::Whole {
        status: 200,
        content_type: "application/json",
        body: string(CEILING + 1),
    };
    let (d, _) = raw_engine(over, watching).await;
    let addr = proxy(&p, &d, LONG_ENGINE_TIMEOUT).await;
    let got = request(addr, method, path, body).await;
    assert_decode_failed(&got, path, &d, &p, &past_the_ceiling());
}

/// An answer that is not JSON (text, or JSON cut short within its full length) is
/// listed as a string of its text, the engine's status kept: the fan-out succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_is_not_json_is_listed_as_its_text() {
    let (_answered, watching) = watch::channel(0u64);
    let text = Answer::Whole {
        status: 200,
        content_type: "text/plain",
        body: b"Success: LoRA adapter 'sql' added".to_vec(),
    };
    let broken = Answer::Whole {
        status: 200,
        content_type: "application/json",
        body: br#"{"status": "ok", "loaded": [1"#.to_vec(),
    };
    let (p, _) = raw_engine(text, watching.clone()).await;
    let (d, _) = raw_engine(broken, watching).await;
    let addr = proxy(&p, &d, LONG_ENGINE_TIMEOUT).await;
    for (method, path, body) in REQUESTS {
        let got = request(addr, method, path, body).await;
        assert_eq!(got.status, 200, "{path}: {}", got.text);
        let v = &got.json;
        assert!(v.get("error").is_none(), "{path}: {v}");
        assert_eq!(v["results"][0]["body"], "Success: LoRA adapter 'sql' added");
        assert_eq!(v["results"][1]["body"], r#"{"status": "ok", "loaded": [1"#);
        assert_eq!(v["results"][1]["status"], 200);
    }
}

/// An answer cut off mid-body (the connection closed before its `content-length`, or
/// before a chunked body's last chunk) is the engine's failure: 502, the other engine
/// listed as it answered, the engine's line saying why the body ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_cut_off_mid_body_is_a_failure_of_that_engine_alone() {
    for chunked in [false, true] {
        let (_answered, watching) = watch::channel(0u64);
        let (p, _) = raw_engine(good(), watching.clone()).await;
        let cut = Answer::Cut {
            chunked,
            hold: false,
        };
        let (d, _) = raw_engine(cut, watching).await;
        let addr = proxy(&p, &d, LONG_ENGINE_TIMEOUT).await;
        for (method, path, body) in REQUESTS {
            let got = request(addr, method, path, body).await;
            let what = format!("{path} (chunked: {chunked})");
            // The library's text and its cause (hyper's words for the early end, which
            // differ by framing).
            assert_decode_failed(&got, &what, &d, &p, CUT_OFF);
            let error = got.json["results"][1]["error"].as_str().unwrap();
            let cause = error.split_once(CUT_OFF).map(|(_, cause)| cause.trim());
            assert!(cause.is_some_and(|c| !c.is_empty()), "{what}: {error}");
        }
    }
}

/// An answer that stops mid-body and never ends is cut at the engine's timeout: the
/// client is answered then, and the engine's connection closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_stalled_mid_body_is_cut_at_the_engine_timeout() {
    for chunked in [false, true] {
        let (_answered, watching) = watch::channel(0u64);
        let (p, _) = raw_engine(good(), watching.clone()).await;
        let stalled = Answer::Cut {
            chunked,
            hold: true,
        };
        let (d, mut reports) = raw_engine(stalled, watching).await;
        let addr = proxy(&p, &d, ENGINE_TIMEOUT).await;
        let (method, path, body) = REQUESTS[0];
        let started = tokio::time::Instant::now();
        let got = request(addr, method, path, body).await;
        assert!(
            started.elapsed() >= ENGINE_TIMEOUT,
            "{:?}",
            started.elapsed()
        );
        let what = format!("{path} (chunked: {chunked})");
        let within = format!("{} ms", ENGINE_TIMEOUT.as_millis());
        assert_decode_failed(&got, &what, &d, &p, &within);
        let report = tokio::time::timeout(ANSWER_WITHIN, reports.recv())
            .await
            .unwrap_or_else(|_| panic!("{what}: the proxy kept the engine's connection"))
            .unwrap();
        assert_eq!(report.written, 7, "{what}: {report:?}");
    }
}

/// An engine that cannot be reached is listed with no status and the transport's error
/// with its causes (the operator tells a refused connection from a name that does not
/// resolve), on every fanned-out route kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_engine_is_listed_with_the_cause_of_its_failure() {
    let (_answered, watching) = watch::channel(0u64);
    let (p, _) = raw_engine(good(), watching).await;
    // A port nothing listens on: bound, then closed.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let d = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let addr = proxy(&p, &d, LONG_ENGINE_TIMEOUT).await;
    for (method, path, body) in REQUESTS {
        let got = request(addr, method, path, body).await;
        let v = &got.json;
        assert_eq!(got.status, 502, "{path}: {}", got.text);
        assert_eq!(v["error"]["code"], "fan_out_failed", "{path}: {v}");
        let results = v["results"].as_array().unwrap();
        assert_eq!(results[0]["status"], 200, "{path}: {v}");
        assert_eq!(results[1]["endpoint"], d.as_str(), "{path}: {v}");
        assert_eq!(
            results[1]["status"],
            Value::Null,
            "{path}: no head came: {v}"
        );
        let error = results[1]["error"].as_str().unwrap();
        // The transport's own words, then its cause (the OS's, which differs by
        // platform: only its presence is asserted).
        let cause = error.strip_prefix("connection failed: ");
        assert!(
            cause.is_some_and(|c| !c.trim().is_empty()),
            "{path}: {error}"
        );
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(error),
            "{path}: the message names the cause: {message}"
        );
    }
}
