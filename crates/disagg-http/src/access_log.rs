//! An access log: one line per request, written when the request ends, in JSON or a
//! readable `key=value` text.
//!
//! [`AccessLog`] is a [`Listener`]: attach it to the orchestrator
//! ([`OrchestratorBuilder::listener`](disagg_core::orchestrator::OrchestratorBuilder::listener))
//! and every request it parses or refuses gets one line from its [`Summary`]; it is a
//! [`RouteListener`] too: attach it to the service
//! ([`PdServiceConfig::route_listeners`](crate::PdServiceConfig::route_listeners)) and
//! every request the orchestrator does not serve gets one from its [`RouteSummary`]. The line
//! is formatted on the request's task and handed to a writer thread through a bounded
//! channel: the request path never waits on the output. The writer gathers the lines
//! of a burst for 20 ms and writes them at once, so a busy proxy does not wake it (nor
//! make a system call) per request; a line shows within about 20 ms of its request's
//! end. When the writer falls behind by [`QUEUE_LINES`] lines (a stdout piped to a
//! stalled reader), further lines are dropped and counted
//! (`disagg_access_log_dropped_total`, [`AccessLog::register_metrics`]) rather than
//! slowing or blocking requests.
//!
//! The fields, in this order (absent values are JSON `null`, `-` in text):
//!
//! | field | meaning |
//! |---|---|
//! | `time` | when the response ended (RFC 3339, UTC, milliseconds) |
//! | `request_id` | the client's request id (its `x-request-id`, or the one drawn for it) |
//! | `engine_request_id` | the engine-side request id of the attempt that answered |
//! | `method` | `POST` for the APIs the orchestrator serves; the request's own otherwise |
//! | `path` | the API's path (`/v1/chat/completions`, `/v1/completions`) |
//! | `model` | the body's `model` |
//! | `stream` | whether the client asked for a stream |
//! | `status` | the status the client got |
//! | `outcome` | `success`, `client_error`, `error` or `cancelled` |
//! | `handoff` | how the KV reached the decode (`x-disagg-handoff`: `kv`, `direct`, ...) |
//! | `fallback` | why the request was served decode-only (`x-disagg-fallback`) |
//! | `prefill` | the prefill endpoint of the attempt that answered |
//! | `decode` | its decode endpoint |
//! | `attempts` | attempts made |
//! | `migrations` | times the decode stream was continued on another decode (mid-stream migration) |
//! | `duration_ms` | arrival to the response's end |
//! | `ttft_ms` | arrival to the first body byte sent |
//! | `queue_ms` | time waiting for admission |
//! | `encode_ms` | the encoder stage (E/P/D), first encoder leg sent to the last answer |
//! | `encode_items` | media items the encoder stage sent to encoders |
//! | `prefill_ms` | the prefill leg, sent to answered |
//! | `handoff_ms` | the KV handoff step, until the decode leg was sent |
//! | `decode_head_ms` | the decode leg, sent to its response head |
//! | `decode_first_chunk_ms` | the decode leg, sent to its first body chunk |
//! | `bytes` | response body bytes sent to the client |
//! | `error` | the OpenAI error code when the request failed or its stream broke |
//! | `trace_id` | the request's trace id, when it is traced |
//! | `key` | the API key that admitted the request, by its short hash (`KeyId`: the first 8 hex digits of its SHA-256; never the key), with `--api-key` |
//! | `route` | how it was served: `orchestrated`, or for the requests the orchestrator does not serve ([`RouteSummary`], [`RouteListener::on_route`]) `forward`, `direct`, `fanout`, `key_refused`, `refused`; their lines have the method, path, status, outcome, the engine a forward went to, `duration_ms`, `bytes` and `key`, the rest absent |

use std::fmt::{self, Write as _};
use std::io::{self, Write};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use disagg_core::endpoint::Role;
use disagg_core::outcome::{Listener, Summary};
use http::HeaderValue;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

use crate::routed::{RouteListener, RouteSummary};

/// Lines the writer may lag behind before lines are dropped: some seconds of a busy
/// proxy's requests (a few MiB at most), enough to ride out a slow terminal or a log
/// shipper's hiccup.
pub const QUEUE_LINES: usize = 16 * 1024;

/// The access log's line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AccessLogFormat {
    /// One JSON object per line, for log shippers.
    Json,
    /// `key=value` pairs after the time, method, path and status, for people.
    Text,
}

/// Writes one line per request (see the [module docs](self)); a [`Listener`].
///
/// Cheap to clone: clones share the writer.
///
/// # Examples
///
/// ```
/// use disagg_http::access_log::{AccessLog, AccessLogFormat};
///
/// let (log, writer) = AccessLog::to_writer(AccessLogFormat::Json, std::io::sink());
/// // Attach `log` with `Orchestrator::builder(..).listener(log.clone())` and
/// // `PdServiceConfig::route_listeners.push(log.clone())`; at shutdown,
/// // once the orchestrator is dropped:
/// writer.close();
/// # drop(log);
/// ```
#[derive(Clone)]
pub struct AccessLog {
    format: AccessLogFormat,
    tx: SyncSender<Option<String>>,
    dropped: Counter,
}

impl fmt::Debug for AccessLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AccessLog")
            .field("format", &self.format)
            .finish_non_exhaustive()
    }
}

/// The access log's writer thread; [`close`](Self::close) it at shutdown so that the
/// last lines are written.
#[derive(Debug)]
pub struct AccessLogWriter {
    tx: SyncSender<Option<String>>,
    thread: Option<JoinHandle<()>>,
}

impl AccessLogWriter {
    /// Write the lines queued so far, then stop the thread and wait for it.
    pub fn close(mut self) {
        // A full queue still takes the end mark once the writer catches up.
        let _ = self.tx.send(None);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl AccessLog {
    /// An access log writing to the process's stdout.
    ///
    /// # Errors
    ///
    /// When the writer thread cannot be spawned.
    pub fn stdout(format: AccessLogFormat) -> io::Result<(AccessLog, AccessLogWriter)> {
        Self::spawn(format, io::stdout())
    }

    /// An access log writing to `out` (a file, a buffer in tests).
    ///
    /// # Panics
    ///
    /// When the writer thread cannot be spawned (see [`stdout`](Self::stdout) for a
    /// fallible start).
    pub fn to_writer(
        format: AccessLogFormat,
        out: impl Write + Send + 'static,
    ) -> (AccessLog, AccessLogWriter) {
        match Self::spawn(format, out) {
            Ok(pair) => pair,
            Err(e) => panic!("spawn the access log's writer thread: {e}"),
        }
    }

    fn spawn(
        format: AccessLogFormat,
        out: impl Write + Send + 'static,
    ) -> io::Result<(AccessLog, AccessLogWriter)> {
        let (tx, rx) = sync_channel(QUEUE_LINES);
        let thread = std::thread::Builder::new()
            .name("disagg-access-log".into())
            .spawn(move || write_lines(rx, out))?;
        Ok((
            AccessLog {
                format,
                tx: tx.clone(),
                dropped: Counter::default(),
            },
            AccessLogWriter {
                tx,
                thread: Some(thread),
            },
        ))
    }

    /// Registers `disagg_access_log_dropped_total` (lines dropped because the writer
    /// fell behind) into `registry`.
    pub fn register_metrics(&self, registry: &mut Registry) {
        registry.register(
            "disagg_access_log_dropped",
            "Access log lines dropped because the writer fell behind.",
            self.dropped.clone(),
        );
    }

    /// The line of `summary` in `format`, without its newline.
    pub fn line(format: AccessLogFormat, summary: &Summary) -> String {
        let mut out = String::with_capacity(512);
        let fields = Fields::of(summary);
        // Writing to a String cannot fail.
        let _ = match format {
            AccessLogFormat::Json => fields.json(&mut out),
            AccessLogFormat::Text => fields.text(&mut out),
        };
        out
    }
}

impl AccessLog {
    /// The line of a request the orchestrator did not serve, in `format`, without its
    /// newline.
    pub fn route_line(format: AccessLogFormat, summary: &RouteSummary) -> String {
        let mut out = String::with_capacity(256);
        let fields = Fields::of_route(summary);
        // Writing to a String cannot fail.
        let _ = match format {
            AccessLogFormat::Json => fields.json(&mut out),
            AccessLogFormat::Text => fields.text(&mut out),
        };
        out
    }

    /// Hand `line` to the writer, or count it dropped.
    fn send(&self, line: String) {
        match self.tx.try_send(Some(line)) {
            Ok(()) => {}
            // Full: the writer is behind; closed: shutting down. Either way the request
            // does not wait.
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.inc();
            }
        }
    }
}

impl Listener for AccessLog {
    fn on_request(&self, summary: &Summary) {
        self.send(Self::line(self.format, summary));
    }
}

/// A line for each request the orchestrator did not serve: attach it to
/// [`PdServiceConfig::route_listeners`](crate::PdServiceConfig::route_listeners) too.
impl RouteListener for AccessLog {
    fn on_route(&self, summary: &RouteSummary) {
        self.send(Self::route_line(self.format, summary));
    }
}

/// How long the writer gathers lines after the first of a burst before writing them:
/// short enough that a line shows within a blink, long enough that a busy proxy's
/// requests do not wake the thread (and make a system call) one by one.
const GATHER: Duration = Duration::from_millis(20);

/// The writer thread: block until a line comes (idle, it costs nothing), then gather
/// what comes for [`GATHER`] at a time and write it in one go, until a round brings
/// nothing; back to blocking then. Stops at the end mark or when every sender is gone.
fn write_lines(rx: Receiver<Option<String>>, out: impl Write) {
    let mut out = io::BufWriter::with_capacity(64 * 1024, out);
    // A closed stdout loses the log, not the proxy: write errors are ignored.
    let put = |out: &mut io::BufWriter<_>, line: String| {
        let _ = out.write_all(line.as_bytes());
        let _ = out.write_all(b"\n");
    };
    'idle: while let Ok(Some(line)) = rx.recv() {
        put(&mut out, line);
        loop {
            std::thread::sleep(GATHER);
            let mut any = false;
            loop {
                match rx.try_recv() {
                    Ok(Some(line)) => {
                        any = true;
                        put(&mut out, line);
                    }
                    Ok(None) | Err(TryRecvError::Disconnected) => break 'idle,
                    Err(TryRecvError::Empty) => break,
                }
            }
            let _ = out.flush();
            if !any {
                continue 'idle;
            }
        }
    }
    let _ = out.flush();
}

/// A value of a field.
enum Value<'a> {
    Str(&'a str),
    Owned(String),
    Uint(u64),
    Bool(bool),
    Millis(Duration),
    Null,
}

impl<'a> Value<'a> {
    fn opt_str(v: Option<&'a str>) -> Self {
        v.map_or(Value::Null, Value::Str)
    }

    fn header(v: Option<&'a HeaderValue>) -> Self {
        match v {
            None => Value::Null,
            Some(v) => match v.to_str() {
                Ok(s) => Value::Str(s),
                Err(_) => Value::Owned(String::from_utf8_lossy(v.as_bytes()).into_owned()),
            },
        }
    }

    fn millis(d: Option<Duration>) -> Self {
        d.map_or(Value::Null, Value::Millis)
    }
}

/// Every field of a line, in order.
struct Fields<'a>([(&'static str, Value<'a>); 29]);

impl<'a> Fields<'a> {
    fn of(s: &'a Summary) -> Self {
        let phases = s.phases;
        let route = s.route.as_ref();
        let end_wall = s.arrival_wall + s.duration;
        Fields([
            ("time", Value::Owned(rfc3339(end_wall))),
            ("request_id", Value::header(s.request_id.as_ref())),
            (
                "engine_request_id",
                Value::header(s.engine_request_id.as_ref()),
            ),
            ("method", Value::Str("POST")),
            ("path", Value::Str(s.api.path())),
            ("model", Value::opt_str(s.model.as_deref())),
            ("stream", Value::Bool(s.stream)),
            ("status", Value::Uint(u64::from(s.status.as_u16()))),
            ("outcome", Value::Str(s.outcome)),
            ("handoff", Value::opt_str(s.handoff)),
            ("fallback", Value::opt_str(s.fallback)),
            (
                "prefill",
                Value::opt_str(
                    route
                        .and_then(|r| r.prefill.as_ref())
                        .map(|e| e.id().as_str()),
                ),
            ),
            (
                "decode",
                Value::opt_str(route.map(|r| r.decode.id().as_str())),
            ),
            ("attempts", Value::Uint(u64::from(s.attempts))),
            ("migrations", Value::Uint(u64::from(s.migrations))),
            ("duration_ms", Value::Millis(s.duration)),
            ("ttft_ms", Value::millis(s.time_to_first_byte)),
            ("queue_ms", Value::millis(s.queued)),
            ("encode_ms", Value::millis(s.encode.map(|e| e.duration))),
            (
                "encode_items",
                s.encode
                    .map_or(Value::Null, |e| Value::Uint(u64::from(e.items))),
            ),
            ("prefill_ms", Value::millis(phases.and_then(|p| p.prefill))),
            ("handoff_ms", Value::millis(phases.and_then(|p| p.handoff))),
            (
                "decode_head_ms",
                Value::millis(phases.and_then(|p| p.decode_head)),
            ),
            (
                "decode_first_chunk_ms",
                Value::millis(phases.and_then(|p| p.decode_first_chunk)),
            ),
            ("bytes", Value::Uint(s.bytes)),
            ("error", Value::opt_str(s.error)),
            (
                "trace_id",
                s.trace
                    .as_ref()
                    .map_or(Value::Null, |t| Value::Owned(hex(&t.trace_id))),
            ),
            ("key", Value::opt_str(s.client.as_deref())),
            ("route", Value::Str("orchestrated")),
        ])
    }

    /// The line of a request the orchestrator did not serve: what it has, the rest
    /// absent.
    fn of_route(s: &'a RouteSummary) -> Self {
        let end_wall = s.arrival_wall + s.duration;
        let engine = |role: Role| {
            Value::opt_str(
                s.endpoint
                    .as_ref()
                    .filter(|e| e.role() == role)
                    .map(|e| e.id().as_str()),
            )
        };
        Fields([
            ("time", Value::Owned(rfc3339(end_wall))),
            ("request_id", Value::header(s.request_id.as_ref())),
            ("engine_request_id", Value::Null),
            ("method", Value::Str(s.method.as_str())),
            ("path", Value::Str(&s.path)),
            ("model", Value::Null),
            ("stream", Value::Null),
            ("status", Value::Uint(u64::from(s.status.as_u16()))),
            ("outcome", Value::Str(s.outcome)),
            ("handoff", Value::Null),
            ("fallback", Value::Null),
            ("prefill", engine(Role::Prefill)),
            ("decode", engine(Role::Decode)),
            ("attempts", Value::Null),
            ("migrations", Value::Null),
            ("duration_ms", Value::Millis(s.duration)),
            ("ttft_ms", Value::Null),
            ("queue_ms", Value::Null),
            ("encode_ms", Value::Null),
            ("encode_items", Value::Null),
            ("prefill_ms", Value::Null),
            ("handoff_ms", Value::Null),
            ("decode_head_ms", Value::Null),
            ("decode_first_chunk_ms", Value::Null),
            ("bytes", Value::Uint(s.bytes)),
            ("error", Value::Null),
            ("trace_id", Value::Null),
            ("key", Value::opt_str(s.client.as_deref())),
            ("route", Value::Str(s.kind.as_str())),
        ])
    }

    fn json(&self, out: &mut String) -> fmt::Result {
        out.push('{');
        for (i, (name, value)) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write!(out, "\"{name}\":")?;
            match value {
                Value::Str(s) => json_string(out, s),
                Value::Owned(s) => json_string(out, s),
                Value::Uint(n) => write!(out, "{n}")?,
                Value::Bool(b) => write!(out, "{b}")?,
                Value::Millis(d) => millis(out, *d)?,
                Value::Null => out.push_str("null"),
            }
        }
        out.push('}');
        Ok(())
    }

    /// `TIME METHOD PATH STATUS key=value...`: the first four fields bare, the rest as
    /// pairs; a value with a space, a quote or `=` is quoted as JSON quotes it.
    fn text(&self, out: &mut String) -> fmt::Result {
        let [time, _, _, method, path, _, _, status, ..] = &self.0;
        for (_, v) in [time, method, path, status] {
            match v {
                Value::Str(s) => out.push_str(s),
                Value::Owned(s) => out.push_str(s),
                Value::Uint(n) => write!(out, "{n}")?,
                _ => out.push('-'),
            }
            out.push(' ');
        }
        out.pop();
        for (name, value) in &self.0 {
            if matches!(*name, "time" | "method" | "path" | "status") {
                continue;
            }
            write!(out, " {name}=")?;
            match value {
                Value::Str(s) => text_value(out, s),
                Value::Owned(s) => text_value(out, s),
                Value::Uint(n) => write!(out, "{n}")?,
                Value::Bool(b) => write!(out, "{b}")?,
                Value::Millis(d) => millis(out, *d)?,
                Value::Null => out.push('-'),
            }
        }
        Ok(())
    }
}

/// Milliseconds with microsecond precision.
fn millis(out: &mut String, d: Duration) -> fmt::Result {
    let us = d.as_micros();
    write!(out, "{}.{:03}", us / 1000, us % 1000)
}

fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn text_value(out: &mut String, s: &str) {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| !c.is_whitespace() && !c.is_control() && c != '"' && c != '=');
    if plain {
        out.push_str(s);
    } else {
        json_string(out, s);
    }
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// `t` as RFC 3339 in UTC with milliseconds (`2026-01-31T12:34:56.789Z`).
fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, day) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// The proleptic Gregorian date of `days` since 1970-01-01: the days-to-civil
/// conversion of Howard Hinnant's "chrono-compatible low-level date algorithms" (public
/// domain), for days on or after the epoch.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    type Shared = Arc<std::sync::Mutex<Vec<u8>>>;

    #[test]
    fn dates_are_civil() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        // 2000-02-29 (a leap day of a year divisible by 400) 12:34:56.789.
        let t = UNIX_EPOCH + Duration::from_millis(951_827_696_789);
        assert_eq!(rfc3339(t), "2000-02-29T12:34:56.789Z");
        let t = UNIX_EPOCH + Duration::from_secs(4_102_444_799);
        assert_eq!(rfc3339(t), "2099-12-31T23:59:59.000Z");
    }

    #[test]
    fn text_values_with_spaces_or_quotes_are_quoted() {
        let mut out = String::new();
        text_value(&mut out, "llama 3 \"8b\"");
        out.push(' ');
        text_value(&mut out, "plain-value");
        assert_eq!(out, "\"llama 3 \\\"8b\\\"\" plain-value");
    }

    #[test]
    fn lines_reach_the_writer_in_order_and_close_flushes_them() {
        struct Out(Shared);
        impl Write for Out {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let buf: Shared = Arc::default();
        let (log, writer) = AccessLog::to_writer(AccessLogFormat::Text, Out(Arc::clone(&buf)));
        for i in 0..100 {
            log.tx.send(Some(format!("line {i}"))).unwrap();
        }
        writer.close();
        let text = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
        let want: String = (0..100).map(|i| format!("line {i}\n")).collect();
        assert_eq!(text, want);
    }
}
