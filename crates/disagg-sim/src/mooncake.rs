//! vLLM's MooncakeConnector (concurrent generation): the request fields, the
//! prefill's bootstrap HTTP server and the decode's client for it.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_TYPE, HOST, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Limited};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{Map, Value, json};
use tokio::net::TcpStream;
use tokio::time::timeout;

use crate::api::{ApiError, truthy};
use crate::body::SimBody;
use crate::generate::KvDigest;
use crate::kv::{self, BootstrapResponse, KvTransferError, MooncakePullRequest};

/// Largest `/query` answer a decode reads.
const MAX_QUERY: usize = 1 << 20;

/// The `GET /query` answer of a prefill: every data-parallel rank with its
/// engine id and the address of its KV (the side channel).
pub(crate) fn query_body(engine_ids: &[String], worker_addr: &str) -> Result<Bytes, String> {
    let ranks: Map<String, Value> = engine_ids
        .iter()
        .enumerate()
        .map(|(rank, id)| {
            (
                rank.to_string(),
                json!({"engine_id": id, "worker_addr": {"0": {"0": worker_addr}}}),
            )
        })
        .collect();
    serde_json::to_vec(&ranks)
        .map(Bytes::from)
        .map_err(|e| e.to_string())
}

/// Serves one connection of a prefill's bootstrap HTTP server, closing it when a
/// request head takes longer than `header_read_timeout` (an idle connection too).
pub(crate) async fn serve_bootstrap(
    query: Bytes,
    header_read_timeout: Duration,
    stream: TcpStream,
) {
    let _ = stream.set_nodelay(true);
    let service = service_fn(move |req: Request<hyper::body::Incoming>| {
        let query = query.clone();
        async move {
            let (status, body) = match (req.method(), req.uri().path()) {
                (&Method::GET, "/query") => (StatusCode::OK, query),
                _ => (
                    StatusCode::NOT_FOUND,
                    Bytes::from_static(br#"{"detail":"Not Found"}"#),
                ),
            };
            let mut response = Response::new(SimBody::full(body));
            *response.status_mut() = status;
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            Ok::<_, Infallible>(response)
        }
    });
    if let Err(e) = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        .serve_connection(TokioIo::new(stream), service)
        .await
    {
        tracing::debug!(error = %e, "bootstrap HTTP connection ended with an error");
    }
}

/// The transfer id of a prefill-side request; `None` when it has none (no
/// `do_remote_decode`, or no string `transfer_id`): vLLM's Mooncake prefill then only
/// warns, serves the request and holds nothing for a decode.
pub(crate) fn prefill_transfer_id(params: Option<&Map<String, Value>>) -> Option<String> {
    let params = params.filter(|p| truthy(p.get("do_remote_decode")));
    params
        .and_then(|p| p.get("transfer_id"))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// What a Mooncake decode does with its `kv_transfer_params` (vLLM's Mooncake
/// scheduler: `get_num_new_matched_tokens`, `update_state_after_alloc`).
#[derive(Debug)]
pub(crate) enum DecodeKv {
    /// No truthy `do_remote_prefill`: the request is served from its prompt, as by an
    /// engine alone.
    Local,
    /// `do_remote_prefill` without `remote_bootstrap_addr`, `remote_engine_id` and
    /// `transfer_id`: "Got invalid KVTransferParams", and the request waits for remote
    /// KV nobody sends.
    Stuck,
    /// The KV is pulled by transfer id.
    Remote(Remote),
}

/// Where a decode finds its KV.
#[derive(Debug)]
pub(crate) struct Remote {
    /// `remote_bootstrap_addr` as given.
    url: String,
    host: String,
    port: u16,
    engine_id: String,
    transfer_id: String,
}

/// Splits `HOST:PORT` (the host possibly bracketed).
fn host_port(authority: &str) -> Option<(String, u16)> {
    let (host, port) = authority.rsplit_once(':')?;
    let host = crate::kv::unbracketed(host);
    let port = port.parse::<u16>().ok().filter(|p| *p != 0)?;
    (!host.is_empty()).then(|| (host.to_owned(), port))
}

/// Reads the decode-side `kv_transfer_params` ([`DecodeKv`]); a
/// `remote_bootstrap_addr` that is no `HOST:PORT` fails the request.
pub(crate) fn decode_remote(params: Option<&Map<String, Value>>) -> Result<DecodeKv, ApiError> {
    let Some(params) = params.filter(|p| truthy(p.get("do_remote_prefill"))) else {
        return Ok(DecodeKv::Local);
    };
    let get = |key| params.get(key).and_then(Value::as_str);
    let (Some(url), Some(engine_id), Some(transfer_id)) = (
        get("remote_bootstrap_addr"),
        get("remote_engine_id"),
        get("transfer_id"),
    ) else {
        return Ok(DecodeKv::Stuck);
    };
    let authority = url.strip_prefix("http://").unwrap_or(url);
    let authority = authority.split('/').next().unwrap_or_default();
    let Some((host, port)) = host_port(authority) else {
        return Err(ApiError::bad_request(format!(
            "Mooncake: remote_bootstrap_addr {url:?} should look like http://HOST:PORT"
        )));
    };
    Ok(DecodeKv::Remote(Remote {
        url: url.trim_end_matches('/').to_owned(),
        host,
        port,
        engine_id: engine_id.to_owned(),
        transfer_id: transfer_id.to_owned(),
    }))
}

/// `GET /query` on the prefill's bootstrap server.
async fn query(remote: &Remote) -> Result<Value, KvTransferError> {
    let url = &remote.url;
    let unreachable = |reason: String| KvTransferError::Unreachable {
        addr: url.clone(),
        reason,
    };
    let stream = kv::connect(&remote.host, remote.port)
        .await
        .map_err(|e| match e {
            KvTransferError::Connect { source, .. } => unreachable(source.to_string()),
            other => unreachable(other.to_string()),
        })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let request = Request::get("/query")
        .header(HOST, format!("{}:{}", remote.host, remote.port))
        .header(CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .map_err(|e| KvTransferError::Bootstrap(e.to_string()))?;
    let exchange = async {
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_QUERY)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((status, body))
    };
    let mut exchange = std::pin::pin!(exchange);
    let mut conn = std::pin::pin!(conn);
    let (status, body) = tokio::select! {
        done = &mut exchange => done,
        // The connection ends once the answer is in (`connection: close`), or fails.
        ended = &mut conn => match ended {
            Ok(()) => exchange.await,
            Err(e) => Err(e.to_string()),
        },
    }
    .map_err(|e| KvTransferError::Bootstrap(format!("GET {url}/query failed: {e}")))?;
    if status != StatusCode::OK {
        return Err(KvTransferError::Bootstrap(format!(
            "bootstrap server {url} answered {status} to GET /query"
        )));
    }
    serde_json::from_slice(&body)
        .map_err(|e| KvTransferError::Bootstrap(format!("malformed GET {url}/query answer: {e}")))
}

/// The side-channel address of the rank of `engine_id` in a `/query` answer.
fn worker_addr(ranks: &Value, remote: &Remote) -> Result<(String, u16), KvTransferError> {
    let rank = ranks
        .as_object()
        .into_iter()
        .flat_map(|ranks| ranks.values())
        .find(|rank| rank.get("engine_id").and_then(Value::as_str) == Some(&remote.engine_id))
        .ok_or_else(|| KvTransferError::UnknownEngine {
            engine_id: remote.engine_id.clone(),
            addr: remote.url.clone(),
        })?;
    rank.get("worker_addr")
        .and_then(|w| w.get("0"))
        .and_then(|w| w.get("0"))
        .and_then(Value::as_str)
        .and_then(host_port)
        .ok_or_else(|| {
            KvTransferError::Bootstrap(format!(
                "GET {}/query: no worker address for engine id {}",
                remote.url, remote.engine_id
            ))
        })
}

/// Pulls the KV of a transfer: looks the engine id up on the bootstrap
/// server, then pulls by transfer id over the side channel of that rank,
/// all within `wait`.
pub(crate) async fn fetch(remote: &Remote, wait: Duration) -> Result<KvDigest, KvTransferError> {
    let transfer_id = &remote.transfer_id;
    let pull = async {
        let ranks = query(remote).await?;
        let (host, port) = worker_addr(&ranks, remote)?;
        let mut stream = kv::connect(&host, port).await?;
        let request = MooncakePullRequest {
            engine_id: remote.engine_id.clone(),
            transfer_id: transfer_id.clone(),
        };
        let answer: BootstrapResponse = kv::request_line(&mut stream, &request).await?;
        answer.into_digest(&format!("transfer id {transfer_id:?}"))
    };
    timeout(wait, pull).await.map_err(|_| {
        KvTransferError::PeerTimeout(format!(
            "no prefill held transfer id {transfer_id:?} within {wait:?}"
        ))
    })?
}
