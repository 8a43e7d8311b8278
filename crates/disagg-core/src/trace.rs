//! W3C Trace Context for a request and its legs: the identities only.
//!
//! When the orchestrator traces ([`OrchestratorConfig::trace_ratio`]), each request gets
//! a trace id (the client's, from its `traceparent`, or a new one), a span id for the
//! proxy's own server span, and, per attempt, span ids for the prefill leg, the handoff
//! step and the decode leg. Each leg carries a `traceparent` naming its own span (and
//! the client's `tracestate`), so an engine that traces (vLLM's
//! `--otlp-traces-endpoint`) puts its spans under the proxy's leg span, in the client's
//! trace.
//!
//! The core only draws and carries the ids; the spans themselves are built when the
//! request ends, from the [`Summary`](crate::outcome::Summary) and each attempt's
//! [`Report`](crate::outcome::Report), which hold the ids and every step's instant. An
//! exporter (the OpenTelemetry SDK in `disagg-otel`) builds them with these ids and
//! times, off the request path. Nothing here allocates per request beyond the two
//! header values a leg carries, and without a ratio configured none of it runs.
//!
//! The sampling decision follows the client's: a `traceparent` whose `sampled` flag is
//! set is sampled, one whose flag is clear is not (the parent decided; honouring it
//! keeps a trace whole); a request without one is sampled when the trace id's low 56
//! bits fall under the ratio, the rule of OpenTelemetry's `TraceIdRatioBased` sampler,
//! so that every component deciding on the same id decides alike.
//!
//! [`OrchestratorConfig::trace_ratio`]: crate::orchestrator::OrchestratorConfig::trace_ratio

use std::sync::atomic::{AtomicU64, Ordering};

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::outcome::TraceIds;

/// The W3C `traceparent` header.
pub(crate) const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
/// The W3C `tracestate` header.
pub(crate) const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

impl TraceIds {
    /// The `traceparent` value naming `span` in this trace.
    pub(crate) fn traceparent(&self, span: &[u8; 8]) -> HeaderValue {
        let mut buf = [0u8; 55];
        buf[..3].copy_from_slice(b"00-");
        hex_into(&mut buf[3..35], &self.trace_id);
        buf[35] = b'-';
        hex_into(&mut buf[36..52], span);
        buf[52] = b'-';
        buf[53] = b'0';
        buf[54] = if self.sampled { b'1' } else { b'0' };
        // Lowercase hex and dashes are always a valid header value.
        HeaderValue::from_bytes(&buf).unwrap_or_else(|_| HeaderValue::from_static(""))
    }

    /// Put this trace's context for `span` on a leg's headers.
    pub(crate) fn inject(&self, span: &[u8; 8], headers: &mut HeaderMap) {
        headers.insert(TRACEPARENT, self.traceparent(span));
        match &self.tracestate {
            Some(state) => {
                headers.insert(TRACESTATE, state.clone());
            }
            None => {
                headers.remove(TRACESTATE);
            }
        }
    }
}

/// A client's trace context, read from its headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Parent {
    pub(crate) trace_id: [u8; 16],
    pub(crate) span_id: [u8; 8],
    pub(crate) sampled: bool,
}

/// Read a `traceparent` value as W3C Trace Context level 1 says: `version-trace-span-flags`
/// in lowercase hex; version `ff`, all-zero ids and malformed values are ignored (the
/// request then starts a trace of its own). A higher version may append fields, which
/// are skipped.
pub(crate) fn parse_traceparent(v: &HeaderValue) -> Option<Parent> {
    let b = v.as_bytes();
    if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return None;
    }
    let version = unhex::<1>(&b[0..2])?[0];
    if version == 0xff || (version == 0 && b.len() != 55) || (b.len() > 55 && b[55] != b'-') {
        return None;
    }
    let trace_id = unhex::<16>(&b[3..35])?;
    let span_id = unhex::<8>(&b[36..52])?;
    let flags = unhex::<1>(&b[53..55])?[0];
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some(Parent {
        trace_id,
        span_id,
        sampled: flags & 1 == 1,
    })
}

/// Draws span and trace ids: a random seed, then a counter through a bijective mixer, so
/// ids are distinct within a process, unrelated to each other, and cost no system call.
#[derive(Debug)]
pub(crate) struct SpanIds {
    seed: u64,
    counter: AtomicU64,
}

impl SpanIds {
    pub(crate) fn new() -> Self {
        let seed = uuid::Uuid::new_v4().as_u128();
        SpanIds {
            seed: (seed >> 64) as u64 ^ seed as u64,
            counter: AtomicU64::new(0),
        }
    }

    fn next(&self) -> u64 {
        loop {
            let n = self.counter.fetch_add(1, Ordering::Relaxed);
            // A zero id is invalid in W3C Trace Context; skip the one input giving it.
            let id = splitmix64(self.seed ^ n);
            if id != 0 {
                return id;
            }
        }
    }

    /// A new span id.
    pub(crate) fn span(&self) -> [u8; 8] {
        self.next().to_be_bytes()
    }

    /// The identities of a request's spans: continuing `headers`' trace when they carry
    /// a valid `traceparent`, sampled by `ratio` otherwise.
    pub(crate) fn request(&self, headers: &HeaderMap, ratio: f64) -> TraceIds {
        let parent = headers.get(TRACEPARENT).and_then(parse_traceparent);
        let (trace_id, parent_span, sampled) = match parent {
            Some(p) => (p.trace_id, Some(p.span_id), p.sampled),
            None => {
                let mut id = [0u8; 16];
                id[..8].copy_from_slice(&self.next().to_be_bytes());
                id[8..].copy_from_slice(&self.next().to_be_bytes());
                (id, None, ratio_samples(&id, ratio))
            }
        };
        let tracestate = parent
            .and_then(|_| headers.get(TRACESTATE))
            .filter(|v| v.len() <= MAX_TRACESTATE)
            .cloned();
        TraceIds {
            trace_id,
            parent: parent_span,
            request: self.span(),
            prefill: self.span(),
            handoff: self.span(),
            decode: self.span(),
            sampled,
            tracestate,
        }
    }

    /// New leg span ids for another attempt of the same request.
    pub(crate) fn next_attempt(&self, ids: &mut TraceIds) {
        ids.prefill = self.span();
        ids.handoff = self.span();
        ids.decode = self.span();
    }
}

/// Longest `tracestate` passed on: the W3C recommendation is that vendors propagate at
/// least 512 characters; a longer one (32 members of 256 at most) is dropped rather than
/// cut, which the spec allows.
const MAX_TRACESTATE: usize = 8192;

/// OpenTelemetry's `TraceIdRatioBased` rule: sampled when the trace id's low 56 bits,
/// read as an integer, fall under `ratio` × 2^56.
fn ratio_samples(trace_id: &[u8; 16], ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    if ratio <= 0.0 || ratio.is_nan() {
        return false;
    }
    let mut low = [0u8; 8];
    low.copy_from_slice(&trace_id[8..]);
    let low56 = u64::from_be_bytes(low) & ((1 << 56) - 1);
    // Exact for 56-bit integers: f64 has a 53-bit mantissa, and the bound is rounded
    // the same way OpenTelemetry's SDKs round it.
    (low56 as f64) < ratio * (1u64 << 56) as f64
}

fn hex_into(out: &mut [u8], bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in bytes.iter().enumerate() {
        out[2 * i] = HEX[usize::from(b >> 4)];
        out[2 * i + 1] = HEX[usize::from(b & 0xf)];
    }
}

/// Lowercase hex into `N` bytes (W3C forbids uppercase in `traceparent`).
fn unhex<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (digit(s[2 * i])? << 4) | digit(s[2 * i + 1])?;
    }
    Some(out)
}

/// A bijective 64-bit mixer (splitmix64's step and finalizer), so consecutive inputs give
/// unrelated outputs (the span ids).
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hv(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).unwrap()
    }

    #[test]
    fn parses_the_specs_example_and_refuses_what_it_forbids() {
        let p = parse_traceparent(&hv(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ))
        .unwrap();
        assert_eq!(p.trace_id[0], 0x4b);
        assert_eq!(p.span_id, [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]);
        assert!(p.sampled);
        let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        assert!(!parse_traceparent(&hv(unsampled)).unwrap().sampled);
        for bad in [
            // uppercase, zero trace, zero span, version ff, short, v00 with extra fields
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse_traceparent(&hv(bad)), None, "{bad}");
        }
        // A later version may carry more fields after a dash.
        let v1 = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-abcd";
        assert!(parse_traceparent(&hv(v1)).is_some());
    }

    #[test]
    fn a_request_continues_the_clients_trace_and_each_leg_names_its_own_span() {
        let ids = SpanIds::new();
        let mut headers = HeaderMap::new();
        headers.insert(
            TRACEPARENT,
            hv("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        headers.insert(TRACESTATE, hv("congo=t61rcWkgMzE"));
        let t = ids.request(&headers, 0.0);
        assert!(t.sampled, "the parent's decision wins over the ratio");
        assert_eq!(
            t.parent,
            Some([0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7])
        );
        let mut leg = HeaderMap::new();
        t.inject(&t.prefill, &mut leg);
        let sent = parse_traceparent(leg.get(TRACEPARENT).unwrap()).unwrap();
        assert_eq!(sent.trace_id, t.trace_id);
        assert_eq!(sent.span_id, t.prefill);
        assert!(sent.sampled);
        assert_eq!(leg.get(TRACESTATE).unwrap(), "congo=t61rcWkgMzE");
        let spans = [t.request, t.prefill, t.handoff, t.decode];
        for (i, a) in spans.iter().enumerate() {
            assert!(spans[i + 1..].iter().all(|b| a != b), "distinct span ids");
        }
    }

    #[test]
    fn without_a_parent_the_ratio_decides_on_the_trace_id() {
        let ids = SpanIds::new();
        let none = HeaderMap::new();
        assert!((0..100).all(|_| ids.request(&none, 1.0).sampled));
        assert!((0..100).all(|_| !ids.request(&none, 0.0).sampled));
        let half = (0..4000)
            .filter(|_| ids.request(&none, 0.5).sampled)
            .count();
        assert!((1700..2300).contains(&half), "{half} of 4000 at ratio 0.5");
        let t = ids.request(&none, 1.0);
        assert_eq!(t.parent, None);
        assert_eq!(t.tracestate, None);
        assert_ne!(t.trace_id, [0; 16]);
    }
}
