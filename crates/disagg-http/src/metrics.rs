//! `GET /metrics`: an orchestrator's counters in the Prometheus text format (0.0.4).
//!
//! | metric | type | meaning |
//! |---|---|---|
//! | `disagg_requests_total` | counter | requests served |
//! | `disagg_requests_in_flight` | gauge | requests admitted and not yet ended |
//! | `disagg_queue_waiting` | gauge | requests waiting for admission |
//! | `disagg_queued_total` | counter | requests that had to wait for admission |
//! | `disagg_queue_rejected_total` | counter | refused with 429: queue full |
//! | `disagg_queue_timeouts_total` | counter | 503 after waiting too long |
//! | `disagg_retries_total` | counter | retries made |
//! | `disagg_retries_denied_total` | counter | retries refused by the retry budget |
//! | `disagg_prefill_fallbacks_total` | counter | requests served decode-only because the prefill could not be had |
//! | `disagg_deadlines_exceeded_total` | counter | requests ended by their total deadline |
//! | `disagg_kv_releases_total` | counter | early KV releases sent |
//! | `disagg_kv_releases_in_flight` | gauge | early KV releases running |
//! | `disagg_endpoint_in_flight{role,endpoint}` | gauge | requests in flight on each endpoint |

use std::fmt::Write;

use disagg_core::Orchestrator;

/// The metrics of `orchestrator` as Prometheus text.
pub fn render(orchestrator: &Orchestrator) -> String {
    let s = orchestrator.stats();
    let mut out = String::with_capacity(2048);
    let rows: [(&str, &str, &str, u64); 12] = [
        ("requests_total", "counter", "Requests served.", s.requests),
        (
            "requests_in_flight",
            "gauge",
            "Requests admitted and not yet ended.",
            s.in_flight,
        ),
        (
            "queue_waiting",
            "gauge",
            "Requests waiting for admission.",
            s.queued_now,
        ),
        (
            "queued_total",
            "counter",
            "Requests that had to wait for admission.",
            s.queued,
        ),
        (
            "queue_rejected_total",
            "counter",
            "Requests refused with 429 because the admission queue was full.",
            s.rejected_queue_full,
        ),
        (
            "queue_timeouts_total",
            "counter",
            "Requests answered 503 after waiting too long for admission.",
            s.queue_timeouts,
        ),
        ("retries_total", "counter", "Retries made.", s.retries),
        (
            "retries_denied_total",
            "counter",
            "Retries not made because the retry budget was spent.",
            s.retries_denied,
        ),
        (
            "prefill_fallbacks_total",
            "counter",
            "Requests served decode-only because their prefill could not be had.",
            s.prefill_fallbacks,
        ),
        (
            "deadlines_exceeded_total",
            "counter",
            "Requests ended by their total deadline.",
            s.deadlines_exceeded,
        ),
        (
            "kv_releases_total",
            "counter",
            "Early KV releases sent.",
            s.kv_releases,
        ),
        (
            "kv_releases_in_flight",
            "gauge",
            "Early KV releases running.",
            s.kv_releases_in_flight,
        ),
    ];
    for (name, kind, help, value) in rows {
        let _ = writeln!(out, "# HELP disagg_{name} {help}");
        let _ = writeln!(out, "# TYPE disagg_{name} {kind}");
        let _ = writeln!(out, "disagg_{name} {value}");
    }
    let set = orchestrator.source().snapshot();
    let _ = writeln!(
        out,
        "# HELP disagg_endpoint_in_flight Requests in flight on an endpoint."
    );
    let _ = writeln!(out, "# TYPE disagg_endpoint_in_flight gauge");
    for (role, eps) in [("prefill", set.prefill()), ("decode", set.decode())] {
        for ep in eps {
            let _ = writeln!(
                out,
                "disagg_endpoint_in_flight{{role=\"{role}\",endpoint=\"{}\"}} {}",
                escape(ep.id().as_str()),
                ep.in_flight()
            );
        }
    }
    out
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
