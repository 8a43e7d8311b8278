//! The hidden `floor` subcommand: the smallest correct vLLM NIXL P/D proxy we know how to
//! write, the yardstick the disagg proxy's cost is compared with (`--floor`).
//!
//! It does what a P/D proxy cannot skip, and nothing else:
//!
//! - hyper's HTTP/1 server and hyper-util's pooled client (`TCP_NODELAY`, keep-alive);
//! - per request, the client's body is collected (at most [`MAX_BODY`]) and scanned
//!   once at the top level by `serde_json` into borrowed raw values: keys and raw
//!   slices, the prompt never decoded;
//! - the prefill leg is written from raw slices: every field but the token limits,
//!   `stream`, `stream_options` and `kv_transfer_params`, then `max_tokens: 1`
//!   (`max_completion_tokens: 1` too when the client sent it), `stream: false` and the
//!   NIXL prefill dict; both legs carry the same `X-Request-Id`;
//! - the prefill's answer is collected (bounded) and scanned at the top level for its
//!   `kv_transfer_params`, which the decode leg carries verbatim beside the client's
//!   fields;
//! - the decode's answer streams back as it comes (hyper's body, not collected), marked
//!   `x-disagg-handoff: kv` so that the bench checks its handoffs against the engines'
//!   counters as it does the disagg proxy's.
//!
//! What it leaves out is everything the disagg proxy adds beyond the handoff: routing
//! policies, health, retries, admission, metrics, validation of the client's fields,
//! access log, edge rules. The ratio disagg / floor is the price of those.
//!
//! It runs as the disagg proxy's server does: `--threads N` OS threads (`floor-0`,
//! `floor-1`, ...), each a single-threaded Tokio runtime with its own listening socket on
//! the one port (`SO_REUSEPORT`: the kernel spreads new connections over them, with the
//! same backlog as the proxy's) and its own client pool, so that a request, its two legs
//! and their pooled connections stay on one thread.
//!
//! Like `proxy`, it prints its bound address on one stdout line once every thread
//! listens, and serves until its stdin closes.

use std::convert::Infallible;
use std::fmt;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use clap::Args;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;

use crate::BoxError;
use crate::proxy::is_loopback_url;

/// The largest client body or prefill answer the floor reads.
const MAX_BODY: usize = 32 << 20;

/// The prefill leg's `kv_transfer_params`, as vLLM's reference proxies send it.
const PREFILL_PARAMS: &[u8] = br#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// Flags of the hidden `floor` subcommand.
#[derive(Debug, Args)]
pub(crate) struct FloorArgs {
    /// The prefill engine, `http://127.0.0.1:PORT`.
    #[arg(long)]
    prefill: String,
    /// The decode engine, `http://127.0.0.1:PORT`.
    #[arg(long)]
    decode: String,
    /// Event-loop threads, each a single-threaded Tokio runtime with its own listening
    /// socket (`SO_REUSEPORT`) and client pool, as the disagg proxy's `--threads`.
    #[arg(
        long,
        default_value_t = 1,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    threads: usize,
    /// Listen here (on 127.0.0.1) and serve until SIGTERM, instead of on a port of its
    /// own until stdin closes (how the bench runs it); for `scripts/instructions.sh`.
    #[arg(long)]
    listen: Option<SocketAddr>,
}

/// The pooled client both legs go through.
type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One thread's floor: the two engines, its own client (and so connection pool), and
/// its request counter.
struct Floor {
    prefill: String,
    decode: String,
    client: HttpClient,
    thread: usize,
    next_id: AtomicU64,
}

/// Run the floor proxy until stdin closes (or SIGTERM with `--listen`).
pub(crate) fn main(args: FloorArgs) -> Result<(), BoxError> {
    for url in [&args.prefill, &args.decode] {
        if !is_loopback_url(url) {
            return Err(format!("engine URLs must be http://127.0.0.1:PORT, not {url}").into());
        }
    }
    let listen = args
        .listen
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    if !listen.ip().is_loopback() {
        return Err(format!("--listen must be on 127.0.0.1, not {listen}").into());
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut threads = Vec::with_capacity(args.threads);
    let mut bound = listen;
    for i in 0..args.threads.max(1) {
        let (tx, rx) = std::sync::mpsc::channel();
        let prefill = args.prefill.trim_end_matches('/').to_owned();
        let decode = args.decode.trim_end_matches('/').to_owned();
        let stop = stop_rx.clone();
        let thread = std::thread::Builder::new()
            .name(format!("floor-{i}"))
            .spawn(move || -> Result<(), BoxError> {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    let listener = match listen_shared(bound) {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = tx.send(Err(e.to_string()));
                            return Err(e.into());
                        }
                    };
                    let _ = tx.send(listener.local_addr().map_err(|e| e.to_string()));
                    let floor = Arc::new(Floor::new(prefill, decode, i));
                    serve(listener, floor, stop).await;
                    Ok(())
                })
            })?;
        // The first thread picks the port (when 0 was asked); the others share it.
        match rx.recv() {
            Ok(Ok(addr)) => bound = addr,
            Ok(Err(e)) => return Err(format!("floor thread {i} cannot listen: {e}").into()),
            Err(_) => {
                return Err(match thread.join() {
                    Ok(Err(e)) => e,
                    _ => format!("floor thread {i} ended at start").into(),
                });
            }
        }
        threads.push(thread);
    }
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{bound}")?;
        out.flush()?;
    }
    wait_for_the_end(args.listen.is_none())?;
    let _ = stop_tx.send(true);
    for (i, thread) in threads.into_iter().enumerate() {
        match thread.join() {
            Ok(result) => result?,
            Err(_) => return Err(format!("floor thread {i} panicked").into()),
        }
    }
    Ok(())
}

/// A listening socket on `addr` that other threads can bind too (`SO_REUSEPORT`), with
/// the disagg proxy's backlog.
fn listen_shared(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(disagg_http::server::LISTEN_BACKLOG)
}

/// Block until stdin closes (`by_stdin`) or SIGTERM comes.
fn wait_for_the_end(by_stdin: bool) -> Result<(), BoxError> {
    let stdin_closed = if by_stdin {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("stdin-watch".into())
            .spawn(move || {
                let mut stdin = std::io::stdin().lock();
                let mut buf = [0u8; 64];
                while matches!(stdin.read(&mut buf), Ok(n) if n > 0) {}
                let _ = tx.send(());
            })?;
        Some(rx)
    } else {
        None
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let closed = async move {
            match stdin_closed {
                Some(rx) => {
                    let _ = rx.await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            () = closed => {}
            _ = terminate.recv() => {}
        }
        Ok(())
    })
}

/// Serve `listener` on this thread until `stop` turns `true`.
async fn serve(listener: TcpListener, floor: Arc<Floor>, mut stop: watch::Receiver<bool>) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stop| *stop) => return,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            // Out of descriptors, or a connection reset before it was accepted: the
            // listener itself is fine, so keep on after a breath.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if stream.set_nodelay(true).is_err() {
            continue;
        }
        let floor = Arc::clone(&floor);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let floor = Arc::clone(&floor);
                async move { Ok::<_, Infallible>(floor.handle(req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// What the floor answers: the decode's body as it streams, or its own error.
type FloorBody = Either<Incoming, Full<Bytes>>;

fn error(status: StatusCode, message: impl fmt::Display) -> Response<FloorBody> {
    let body = serde_json::json!({"error": {"message": message.to_string(), "type": "floor_error", "code": status.as_u16()}});
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body.to_string()))));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

impl Floor {
    /// Thread `thread`'s floor. Its client spawns its connections on the runtime it is
    /// first used on: this thread's.
    fn new(prefill: String, decode: String, thread: usize) -> Floor {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .build(connector);
        Floor {
            prefill,
            decode,
            client,
            thread,
            next_id: AtomicU64::new(0),
        }
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<FloorBody> {
        if req.method() != Method::POST || req.uri().path() != "/v1/chat/completions" {
            return error(
                StatusCode::NOT_FOUND,
                "the floor serves POST /v1/chat/completions",
            );
        }
        let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return error(StatusCode::BAD_REQUEST, e),
        };
        let top = match serde_json::from_slice::<TopLevel<'_>>(&body) {
            Ok(top) => top,
            Err(e) => return error(StatusCode::BAD_REQUEST, e),
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let request_id = match HeaderValue::try_from(format!("floor-{}-{id}", self.thread)) {
            Ok(v) => v,
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e),
        };

        let prefill_body = top.prefill_leg(body.len());
        let answer = match self.send(&self.prefill, prefill_body, &request_id).await {
            Ok(resp) if resp.status().is_success() => {
                match Limited::new(resp.into_body(), MAX_BODY).collect().await {
                    Ok(b) => b.to_bytes(),
                    Err(e) => return error(StatusCode::BAD_GATEWAY, e),
                }
            }
            Ok(resp) => {
                return error(
                    StatusCode::BAD_GATEWAY,
                    format!("the prefill answered {}", resp.status()),
                );
            }
            Err(e) => return error(StatusCode::BAD_GATEWAY, e),
        };
        let handoff = match serde_json::from_slice::<TopLevel<'_>>(&answer) {
            Ok(a) => a.get("kv_transfer_params").map(RawValue::get),
            Err(e) => return error(StatusCode::BAD_GATEWAY, e),
        };
        let handoff = handoff.filter(|h| *h != "null" && *h != "{}");
        let decode_body = top.decode_leg(body.len(), handoff);
        match self.send(&self.decode, decode_body, &request_id).await {
            Ok(resp) => {
                let (mut parts, body) = resp.into_parts();
                if handoff.is_some() {
                    parts
                        .headers
                        .insert("x-disagg-handoff", HeaderValue::from_static("kv"));
                }
                Response::from_parts(parts, Either::Left(body))
            }
            Err(e) => error(StatusCode::BAD_GATEWAY, e),
        }
    }

    async fn send(
        &self,
        base: &str,
        body: Bytes,
        request_id: &HeaderValue,
    ) -> Result<Response<Incoming>, BoxError> {
        let req = Request::post(format!("{base}/v1/chat/completions"))
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-request-id", request_id.clone())
            .body(Full::new(body))?;
        Ok(self.client.request(req).await?)
    }
}

/// A JSON object's top level: each key beside the raw bytes of its value.
struct TopLevel<'a>(Vec<(&'a str, &'a RawValue)>);

impl<'a> TopLevel<'a> {
    fn get(&self, key: &str) -> Option<&'a RawValue> {
        self.0.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    }

    /// Write `"key":value` for every field `keep` accepts, comma-separated.
    fn write_fields(&self, out: &mut BytesMut, keep: impl Fn(&str) -> bool) {
        for (key, value) in &self.0 {
            if !keep(key) {
                continue;
            }
            if out.len() > 1 {
                out.put_u8(b',');
            }
            out.put_u8(b'"');
            out.put_slice(key.as_bytes());
            out.put_slice(b"\":");
            out.put_slice(value.get().as_bytes());
        }
    }

    fn prefill_leg(&self, size: usize) -> Bytes {
        let mut out = BytesMut::with_capacity(size + PREFILL_PARAMS.len() + 64);
        out.put_u8(b'{');
        self.write_fields(&mut out, |k| {
            !matches!(
                k,
                "max_tokens"
                    | "max_completion_tokens"
                    | "stream"
                    | "stream_options"
                    | "kv_transfer_params"
            )
        });
        if out.len() > 1 {
            out.put_u8(b',');
        }
        out.put_slice(b"\"max_tokens\":1,");
        if self.get("max_completion_tokens").is_some() {
            out.put_slice(b"\"max_completion_tokens\":1,");
        }
        out.put_slice(b"\"stream\":false,\"kv_transfer_params\":");
        out.put_slice(PREFILL_PARAMS);
        out.put_u8(b'}');
        out.freeze()
    }

    fn decode_leg(&self, size: usize, handoff: Option<&str>) -> Bytes {
        let extra = handoff.map_or(0, str::len);
        let mut out = BytesMut::with_capacity(size + extra + 32);
        out.put_u8(b'{');
        self.write_fields(&mut out, |k| k != "kv_transfer_params");
        if let Some(h) = handoff {
            if out.len() > 1 {
                out.put_u8(b',');
            }
            out.put_slice(b"\"kv_transfer_params\":");
            out.put_slice(h.as_bytes());
        }
        out.put_u8(b'}');
        out.freeze()
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for TopLevel<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for Fields<'a> {
            type Value = TopLevel<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object (keys without escapes)")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
                let mut fields = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some(entry) = map.next_entry::<&'de str, &'de RawValue>()? {
                    fields.push(entry);
                }
                Ok(TopLevel(fields))
            }
        }
        d.deserialize_map(Fields(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legs(client: &str, answer: &str) -> (String, String) {
        let top: TopLevel<'_> = serde_json::from_str(client).expect("client body");
        let prefill = top.prefill_leg(client.len());
        let answer: TopLevel<'_> = serde_json::from_str(answer).expect("answer");
        let handoff = answer.get("kv_transfer_params").map(RawValue::get);
        let decode = top.decode_leg(client.len(), handoff);
        (
            String::from_utf8(prefill.to_vec()).expect("utf-8"),
            String::from_utf8(decode.to_vec()).expect("utf-8"),
        )
    }

    #[test]
    fn prefill_leg_asks_one_token_and_no_stream() {
        let (prefill, _) = legs(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":9,"stream":true,"stream_options":{"include_usage":true}}"#,
            r#"{"kv_transfer_params":{"remote_engine_id":"e"}}"#,
        );
        let v: serde_json::Value = serde_json::from_str(&prefill).expect("valid JSON");
        assert_eq!(v["max_tokens"], 1);
        assert_eq!(v["max_completion_tokens"], 1);
        assert_eq!(v["stream"], false);
        assert!(v.get("stream_options").is_none());
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(v["messages"][0]["content"], "hi");
    }

    #[test]
    fn decode_leg_keeps_the_client_fields_and_carries_the_handoff_verbatim() {
        let (_, decode) = legs(
            r#"{"model":"m","messages":[],"max_tokens":7,"stream":true,"kv_transfer_params":{"evil":1}}"#,
            r#"{"id":"x","kv_transfer_params":{"remote_block_ids":[1,2],"remote_port":5600}}"#,
        );
        let v: serde_json::Value = serde_json::from_str(&decode).expect("valid JSON");
        assert_eq!(v["max_tokens"], 7);
        assert_eq!(v["stream"], true);
        assert_eq!(
            v["kv_transfer_params"],
            serde_json::json!({"remote_block_ids": [1, 2], "remote_port": 5600})
        );
    }

    #[test]
    fn a_body_that_is_not_an_object_is_refused() {
        assert!(serde_json::from_str::<TopLevel<'_>>("[1,2]").is_err());
        assert!(serde_json::from_str::<TopLevel<'_>>(r#"{"a":1"#).is_err());
    }
}
