//! A minimal HTTP/1.1 client over real loopback sockets for the tests.

#![allow(dead_code, unreachable_pub, missing_docs)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use disagg_sim::{SimConfig, SimEngine, Stats};
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// One client connection; dropping it closes the socket.
pub struct Conn {
    pub sender: SendRequest<Full<Bytes>>,
    task: JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Conn {
    pub async fn open(addr: SocketAddr) -> Conn {
        let stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Conn { sender, task }
    }

    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Vec<u8>>,
    ) -> Response<Incoming> {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "sim");
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .unwrap();
        self.sender.ready().await.unwrap();
        self.sender.send_request(req).await.unwrap()
    }
}

/// A complete answer.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8(self.body.to_vec()).unwrap()
    }

    /// The JSON payloads of the SSE events (`[DONE]` as the string "[DONE]").
    pub fn events(&self) -> Vec<Value> {
        sse_events(&self.text())
    }
}

pub fn sse_events(text: &str) -> Vec<Value> {
    assert!(text.is_empty() || text.ends_with("\n\n"), "{text:?}");
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let data = e.strip_prefix("data: ").unwrap_or_else(|| panic!("{e:?}"));
            if data == "[DONE]" {
                Value::String("[DONE]".into())
            } else {
                serde_json::from_str(data).unwrap()
            }
        })
        .collect()
}

pub async fn read(resp: Response<Incoming>) -> Reply {
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        headers,
        body,
    }
}

pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> Reply {
    let mut conn = Conn::open(addr).await;
    let resp = conn.send(method, path, headers, body).await;
    read(resp).await
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    request(
        addr,
        "POST",
        path,
        &[],
        Some(serde_json::to_vec(body).unwrap()),
    )
    .await
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    request(addr, "GET", path, &[], None).await
}

/// Waits (up to 5 s) until the engine's stats satisfy `pred`.
pub async fn wait_for(engine: &SimEngine, pred: impl Fn(&Stats) -> bool) -> Stats {
    for _ in 0..500 {
        let s = engine.stats();
        if pred(&s) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("condition never met: {:?}", engine.stats());
}

/// Sends a POST by hand and returns the open socket without reading the
/// answer: dropping it makes the client leave.
pub async fn raw_post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> TcpStream {
    use tokio::io::AsyncWriteExt;
    let body = serde_json::to_string(body).unwrap();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!(
                "POST {path} HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    stream
}

/// A loopback port nobody listens on (connection refused), and the socket that holds
/// it: bound, never listening, so no listener the test starts meanwhile (an engine's
/// ephemeral port) can take it while the socket lives. Keep the socket to the end.
pub fn unused_port() -> (u16, tokio::net::TcpSocket) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    (socket.local_addr().unwrap().port(), socket)
}

/// The `error.message` of an error answer in vLLM's shape (status and code
/// checked to agree).
pub fn error_message(reply: &Reply) -> String {
    let v = reply.json();
    assert_eq!(v["error"]["code"], reply.status, "{v}");
    v["error"]["message"].as_str().unwrap().to_owned()
}

/// Asserts a 500 `"KV transfer failed: ..."` answer that says `why`.
pub fn assert_transfer_failed(reply: &Reply, why: &str) {
    assert_eq!(reply.status, 500, "{}", reply.text());
    let message = error_message(reply);
    assert!(
        message.starts_with("KV transfer failed") && message.contains(why),
        "{message:?} does not say {why:?}"
    );
}

/// An SGLang decode's failed KV transfer: its 500 in SGLang's `ErrorResponse` shape
/// ([`sglang_error_message`]), the simulator's message saying `why`.
pub fn assert_sglang_transfer_failed(reply: &Reply, why: &str) {
    assert_eq!(reply.status, 500, "{}", reply.text());
    let message = sglang_error_message(reply);
    assert!(
        message.starts_with("KV transfer failed") && message.contains(why),
        "{message:?} does not say {why:?}"
    );
}

/// POSTs JSON with extra headers.
pub async fn post_with(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> Reply {
    request(
        addr,
        "POST",
        path,
        headers,
        Some(serde_json::to_vec(body).unwrap()),
    )
    .await
}

/// A vLLM NIXL prefill (`prefill-0`) and decode (`decode-0`) with the default settings.
pub async fn pair() -> (SimEngine, SimEngine) {
    let prefill = SimEngine::start(SimConfig {
        engine_id: Some("prefill-0".into()),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let decode = SimEngine::start(SimConfig {
        engine_id: Some("decode-0".into()),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    (prefill, decode)
}

/// The `message` of an error answer in SGLang's `ErrorResponse` shape
/// (`{"object":"error","message":..,"type":"<status>","param":null,"code":<status>}`,
/// as an SGLang decode answers a failed KV transfer; status, type and code checked
/// to agree).
pub fn sglang_error_message(reply: &Reply) -> String {
    let v = reply.json();
    assert_eq!(v["object"], "error", "{v}");
    assert_eq!(v["code"], reply.status, "{v}");
    assert_eq!(v["type"], reply.status.to_string(), "{v}");
    v["message"].as_str().unwrap().to_owned()
}

/// A 200 event stream, as vLLM's and SGLang's servers type it.
pub fn assert_event_stream(reply: &Reply) {
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.headers["content-type"], "text/event-stream; charset=utf-8",
        "{:?}",
        reply.headers
    );
}
