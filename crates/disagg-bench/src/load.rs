//! The load generator: one pooled hyper-util client, `N` tasks each sending one request
//! after another, each keeping its own latencies; merged when the phase ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::task::JoinSet;

use crate::BoxError;

/// The client every phase shares.
pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// How a stream must end.
const DONE: &[u8] = b"data: [DONE]\n\n";

/// The most of an error answer's body read (its first 300 characters are shown).
const MAX_ERROR_BODY: usize = 1 << 20;

/// The most of a non-streamed answer read: far above any answer the bench asks for.
const MAX_ANSWER: usize = 16 << 20;

/// Past the phase's own duration, how long its last requests may take before the phase
/// is declared stuck.
const GRACE: Duration = Duration::from_secs(15);

/// A client with a pool large enough for every connection of every phase, and
/// `TCP_NODELAY`.
pub(crate) fn client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.enforce_http(true);
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(600))
        .pool_max_idle_per_host(4096)
        .build(connector)
}

/// What a phase sends, and how answers are checked.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// `http://127.0.0.1:port/v1/chat/completions`.
    pub(crate) uri: Uri,
    /// The request body, prebuilt.
    pub(crate) body: Bytes,
    /// Whether the answer is an SSE stream, which must end with `data: [DONE]`.
    pub(crate) stream: bool,
    /// Whether the answer must say `x-disagg-handoff: kv` (through the proxy).
    pub(crate) expect_kv: bool,
    /// Counts the requests sent and what their answers claimed, over every run of
    /// every target sharing it, for the comparison with the engines' own counters.
    pub(crate) claims: Arc<Claims>,
}

/// What a set of targets sent and what their answers' heads claimed: the proxy's
/// `x-disagg-handoff: kv` is its own word, which the bench checks against the KV
/// handoffs the engines counted (`crate::report::HandoffCheck`).
#[derive(Debug, Default)]
pub(crate) struct Claims {
    sent: AtomicU64,
    kv: AtomicU64,
}

impl Claims {
    /// Requests sent.
    pub(crate) fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Answers whose head said `x-disagg-handoff: kv`, whatever became of their body.
    pub(crate) fn kv(&self) -> u64 {
        self.kv.load(Ordering::Relaxed)
    }
}

/// Counts the streams whose answer head arrived and whose body has not ended.
#[derive(Debug, Default)]
pub(crate) struct Gauge {
    open: AtomicUsize,
    max: AtomicUsize,
}

impl Gauge {
    /// Streams open now.
    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// The most ever open at once.
    pub(crate) fn max(&self) -> usize {
        self.max.load(Ordering::Relaxed)
    }

    fn enter(&self) -> GaugeGuard<'_> {
        let now = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        self.max.fetch_max(now, Ordering::Relaxed);
        GaugeGuard(self)
    }
}

struct GaugeGuard<'a>(&'a Gauge);

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One answer's timing.
#[derive(Debug, Clone, Copy)]
struct Sample {
    latency: Duration,
    ttft: Duration,
}

/// What a phase measured.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// Answers that passed every check.
    pub(crate) ok: u64,
    /// Requests that failed (transport error, status not 200, bad body).
    pub(crate) errors: u64,
    /// The first error's description.
    pub(crate) first_error: Option<String>,
    /// From the first request sent to the last answer received.
    pub(crate) elapsed: Duration,
    /// Whole-answer latencies of the successful requests, sorted, in ns.
    pub(crate) latency_ns: Vec<u64>,
    /// Times to first SSE data frame (whole answer when not streaming), sorted, in ns.
    pub(crate) ttft_ns: Vec<u64>,
}

impl Outcome {
    /// Successful answers per second.
    pub(crate) fn throughput(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.ok as f64 / secs
        } else {
            0.0
        }
    }

    fn merge(&mut self, other: Outcome) {
        self.ok += other.ok;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        self.latency_ns.extend(other.latency_ns);
        self.ttft_ns.extend(other.ttft_ns);
    }
}

/// The `p`-th quantile (0..=1, nearest rank) of `sorted`, in ms.
pub(crate) fn quantile_ms(sorted: &[u64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    let i = rank.clamp(1, sorted.len()) - 1;
    Some(sorted[i] as f64 / 1e6)
}

/// How the streams of the memory measurement are held.
#[derive(Debug, Clone)]
pub(crate) struct Hold {
    /// Counts the streams open.
    pub(crate) gauge: Arc<Gauge>,
    /// Task `i` starts `i × stagger` after the first.
    pub(crate) stagger: Duration,
}

/// Send `target` from `concurrency` tasks, each one request after the other, until
/// `duration` has passed or `max_requests` were sent in all; the requests in flight
/// when time is up complete. With `hold`, the tasks start staggered and the open
/// streams are counted.
///
/// # Errors
///
/// When `max_requests` is below `concurrency` (fewer tasks would run than asked), a
/// task fails, or answers are still missing [`GRACE`] after `duration`.
pub(crate) async fn run(
    client: &HttpClient,
    target: &Target,
    concurrency: usize,
    duration: Duration,
    max_requests: u64,
    hold: Option<Hold>,
) -> Result<Outcome, BoxError> {
    let concurrency = concurrency.max(1);
    let n = concurrency as u64;
    if max_requests < n {
        return Err(format!(
            "{max_requests} requests cannot keep concurrency {concurrency}: at most \
             {max_requests} clients would run"
        )
        .into());
    }
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = JoinSet::new();
    for i in 0..n {
        // Split the request budget evenly; tasks left with none are not started.
        let quota = max_requests / n + u64::from(i < max_requests % n);
        if quota == 0 {
            continue;
        }
        let client = client.clone();
        let target = target.clone();
        let gauge = hold.as_ref().map(|h| h.gauge.clone());
        let delay = hold.as_ref().map_or(Duration::ZERO, |h| {
            h.stagger
                .saturating_mul(u32::try_from(i).unwrap_or(u32::MAX))
        });
        tasks.spawn(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let mut out = Outcome {
                latency_ns: Vec::with_capacity(quota.min(1 << 17) as usize),
                ttft_ns: Vec::with_capacity(if target.stream {
                    quota.min(1 << 17) as usize
                } else {
                    0
                }),
                ..Outcome::default()
            };
            let mut sent = 0;
            while sent < quota && Instant::now() < deadline {
                sent += 1;
                match one(&client, &target, gauge.as_deref()).await {
                    Ok(s) => {
                        out.ok += 1;
                        out.latency_ns.push(nanos(s.latency));
                        if target.stream {
                            out.ttft_ns.push(nanos(s.ttft));
                        }
                    }
                    Err(e) => {
                        out.errors += 1;
                        out.first_error.get_or_insert(e);
                    }
                }
            }
            out
        });
    }
    let mut total = Outcome::default();
    let collect = async {
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok(out) => total.merge(out),
                Err(e) => return Err(format!("a load task failed: {e}")),
            }
        }
        Ok(())
    };
    let finished = tokio::time::timeout(duration + GRACE, collect).await;
    match finished {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => {
            tasks.abort_all();
            return Err(format!(
                "requests still unanswered {} s after the phase's end",
                GRACE.as_secs()
            )
            .into());
        }
    }
    total.elapsed = start.elapsed();
    if !target.stream {
        // Not streamed: the first token arrives with the whole answer.
        total.ttft_ns = total.latency_ns.clone();
    }
    total.latency_ns.sort_unstable();
    total.ttft_ns.sort_unstable();
    Ok(total)
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// One request, checked.
async fn one(
    client: &HttpClient,
    target: &Target,
    gauge: Option<&Gauge>,
) -> Result<Sample, String> {
    let start = Instant::now();
    target.claims.sent.fetch_add(1, Ordering::Relaxed);
    let mut req = Request::new(Full::new(target.body.clone()));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = target.uri.clone();
    req.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("request failed: {}", chain(&e)))?;
    let status = resp.status();
    let handoff = resp.headers().get("x-disagg-handoff");
    let claims_kv = handoff.map(HeaderValue::as_bytes) == Some(b"kv");
    if claims_kv {
        target.claims.kv.fetch_add(1, Ordering::Relaxed);
    }
    if status != StatusCode::OK {
        let body = Limited::new(resp.into_body(), MAX_ERROR_BODY)
            .collect()
            .await
            .map(|c| c.to_bytes());
        let text = match &body {
            Ok(bytes) => String::from_utf8_lossy(bytes).chars().take(300).collect(),
            Err(e) => format!("(body unread: {})", limited_error(&**e, MAX_ERROR_BODY)),
        };
        return Err(format!("status {status}: {text}"));
    }
    if target.expect_kv && !claims_kv {
        return Err(format!(
            "x-disagg-handoff is {handoff:?}, not \"kv\": the KV was not handed over"
        ));
    }
    let mut body = resp.into_body();
    if !target.stream {
        let bytes = Limited::new(body, MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| format!("answer body broke: {}", limited_error(&*e, MAX_ANSWER)))?
            .to_bytes();
        if !bytes.starts_with(b"{") {
            return Err("the answer is not a JSON object".to_owned());
        }
        let latency = start.elapsed();
        return Ok(Sample {
            latency,
            ttft: latency,
        });
    }
    let _open = gauge.map(Gauge::enter);
    let mut ttft = None;
    let mut tail: Vec<u8> = Vec::with_capacity(2 * DONE.len());
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("stream broke: {}", chain(&e)))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        if ttft.is_none() && data.windows(5).any(|w| w == b"data:") {
            ttft = Some(start.elapsed());
        }
        if data.len() >= DONE.len() {
            tail.clear();
            tail.extend_from_slice(&data[data.len() - DONE.len()..]);
        } else {
            tail.extend_from_slice(&data);
            let excess = tail.len().saturating_sub(DONE.len());
            tail.drain(..excess);
        }
    }
    let latency = start.elapsed();
    if tail != DONE {
        return Err("the stream did not end with `data: [DONE]`".to_owned());
    }
    Ok(Sample {
        latency,
        ttft: ttft.unwrap_or(latency),
    })
}

/// A [`Limited`] body's error: its ceiling named, or the error and its sources.
fn limited_error(e: &(dyn std::error::Error + 'static), limit: usize) -> String {
    if e.is::<http_body_util::LengthLimitError>() {
        format!("larger than {limit} bytes")
    } else {
        chain(e)
    }
}

/// An error and its sources, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A server that answers every connection with `head` and then a chunked body
    /// that never ends.
    async fn endless(head: &'static str) -> Result<Uri, BoxError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = conn.read(&mut buf).await;
                    let chunk = format!("10000\r\n{}\r\n", "x".repeat(0x10000));
                    if conn.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    while conn.write_all(chunk.as_bytes()).await.is_ok() {}
                });
            }
        });
        Ok(format!("http://{addr}/v1/chat/completions").parse()?)
    }

    fn target(uri: Uri) -> Target {
        Target {
            uri,
            body: Bytes::from_static(b"{}"),
            stream: false,
            expect_kv: false,
            claims: Arc::new(Claims::default()),
        }
    }

    #[tokio::test]
    async fn an_endless_error_body_is_cut_at_its_ceiling() -> Result<(), BoxError> {
        let uri = endless(
            "HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\n\
             transfer-encoding: chunked\r\n\r\n",
        )
        .await?;
        let answer =
            tokio::time::timeout(Duration::from_secs(20), one(&client(), &target(uri), None)).await;
        let err = match answer {
            Ok(Err(e)) => e,
            Ok(Ok(_)) => panic!("a 500 passed"),
            Err(_) => panic!("the error body was read past 20 s"),
        };
        assert!(err.starts_with("status 500"), "{err}");
        Ok(())
    }

    #[tokio::test]
    async fn an_endless_answer_is_cut_at_its_ceiling() -> Result<(), BoxError> {
        let uri = endless(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
             transfer-encoding: chunked\r\n\r\n",
        )
        .await?;
        let answer =
            tokio::time::timeout(Duration::from_secs(20), one(&client(), &target(uri), None)).await;
        let err = match answer {
            Ok(Err(e)) => e,
            Ok(Ok(_)) => panic!("an endless answer passed"),
            Err(_) => panic!("the answer was read past 20 s"),
        };
        assert!(err.contains("larger than"), "{err}");
        Ok(())
    }

    #[tokio::test]
    async fn fewer_requests_than_clients_are_refused() {
        // Nothing listens there: the run must refuse before sending anything.
        let uri = Uri::from_static("http://127.0.0.1:9/v1/chat/completions");
        let out = run(&client(), &target(uri), 4, Duration::from_secs(1), 3, None).await;
        let err = out.err().map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains("concurrency")),
            "{err:?}"
        );
    }

    #[test]
    fn nearest_rank_quantiles() {
        let v: Vec<u64> = (1..=100).map(|i| i * 1_000_000).collect();
        assert_eq!(quantile_ms(&v, 0.5), Some(50.0));
        assert_eq!(quantile_ms(&v, 0.99), Some(99.0));
        assert_eq!(quantile_ms(&v, 0.0), Some(1.0));
        assert_eq!(quantile_ms(&[7_000_000], 0.99), Some(7.0));
        assert_eq!(quantile_ms(&[], 0.5), None);
    }
}
