//! The figures of a run, the targets, the printed table and the JSON.

use std::fmt::Write;
use std::time::Duration;

use serde_json::{Value, json};

use crate::load::{Outcome, quantile_ms};
use crate::run::{LATENCY_CONCURRENCY, THROUGHPUT_CONCURRENCY};

/// Where the load generator sends its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Via {
    /// Straight to the decode engine: the baseline.
    Direct,
    /// Through the proxy, disaggregated over the prefill and the decode engine.
    Proxy,
    /// Through the floor proxy (`--floor`), disaggregated the same way.
    Floor,
}

impl Via {
    fn name(self) -> &'static str {
        match self {
            Via::Direct => "direct",
            Via::Proxy => "proxy",
            Via::Floor => "floor",
        }
    }
}

fn mode(stream: bool) -> &'static str {
    if stream { "stream" } else { "non-stream" }
}

/// The settings and the machine of a run.
#[derive(Debug, Clone)]
pub(crate) struct RunConfig {
    pub(crate) duration: Duration,
    pub(crate) warmup: Duration,
    pub(crate) max_requests: u64,
    pub(crate) proxy_threads: usize,
    pub(crate) engine_threads: usize,
    pub(crate) client_threads: usize,
    pub(crate) tokens: u32,
    /// The actual body size.
    pub(crate) body_bytes: usize,
    /// Image parts per request (`--images`; 0: text only, no encoder).
    pub(crate) images: usize,
    pub(crate) streams: usize,
    pub(crate) stream_delay: Duration,
    pub(crate) ticks_per_sec: f64,
    /// Whether `ticks_per_sec` came from `getconf CLK_TCK` (else 100 is assumed).
    pub(crate) ticks_read: bool,
    pub(crate) cpus: usize,
    pub(crate) cpu_model: String,
    pub(crate) mem_total_kib: u64,
}

/// The proxy process's CPU in a phase.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProxyCpu {
    /// CPU µs (user + system) per successful request.
    pub(crate) us_per_req: f64,
    /// The part of it spent in the kernel, 0..=1 (always from the clock ticks, the only
    /// reading that splits user and kernel time).
    pub(crate) system_share: f64,
    /// Which clock `us_per_req` was read from.
    pub(crate) clock: CpuClock,
}

/// Where a phase's proxy CPU time was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CpuClock {
    /// The scheduler's nanoseconds per thread (`/proc/<pid>/task/*/schedstat`).
    Scheduler,
    /// Clock ticks of `/proc/<pid>/stat` (a thread ended during the phase, or the kernel
    /// keeps no schedstat).
    Ticks,
}

impl CpuClock {
    fn as_str(self) -> &'static str {
        match self {
            CpuClock::Scheduler => "schedstat",
            CpuClock::Ticks => "ticks",
        }
    }
}

/// The figures of one measured phase.
#[derive(Debug, Clone)]
pub(crate) struct PhaseStats {
    pub(crate) via: Via,
    pub(crate) stream: bool,
    pub(crate) concurrency: usize,
    pub(crate) ok: u64,
    pub(crate) errors: u64,
    pub(crate) warmup_errors: u64,
    pub(crate) first_error: Option<String>,
    pub(crate) elapsed_s: f64,
    pub(crate) throughput: f64,
    pub(crate) p50_ms: Option<f64>,
    pub(crate) p99_ms: Option<f64>,
    pub(crate) ttft_p50_ms: Option<f64>,
    pub(crate) ttft_p99_ms: Option<f64>,
    /// The proxy process's CPU (proxy phases only).
    pub(crate) proxy_cpu: Option<ProxyCpu>,
    /// The bench process's CPU (engines and load generator) per successful request, µs.
    pub(crate) bench_cpu_us: f64,
}

impl PhaseStats {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        via: Via,
        stream: bool,
        concurrency: usize,
        out: &Outcome,
        warmup_first_error: Option<String>,
        warmup_errors: u64,
        proxy_cpu: Option<ProxyCpu>,
        bench_cpu_us: f64,
    ) -> PhaseStats {
        PhaseStats {
            via,
            stream,
            concurrency,
            ok: out.ok,
            errors: out.errors,
            warmup_errors,
            first_error: out.first_error.clone().or(warmup_first_error),
            elapsed_s: out.elapsed.as_secs_f64(),
            throughput: out.throughput(),
            p50_ms: quantile_ms(&out.latency_ns, 0.5),
            p99_ms: quantile_ms(&out.latency_ns, 0.99),
            ttft_p50_ms: quantile_ms(&out.ttft_ns, 0.5),
            ttft_p99_ms: quantile_ms(&out.ttft_ns, 0.99),
            proxy_cpu,
            bench_cpu_us,
        }
    }

    fn all_errors(&self) -> u64 {
        self.errors + self.warmup_errors
    }

    /// One line for the progress log.
    pub(crate) fn progress_line(&self) -> String {
        let mut s = format!(
            "  {:<6} {:<10} c={:<3} {:>9} req/s  p50 {} ms  p99 {} ms",
            self.via.name(),
            mode(self.stream),
            self.concurrency,
            thousands(self.throughput),
            ms(self.p50_ms),
            ms(self.p99_ms),
        );
        if let Some(cpu) = self.proxy_cpu {
            let _ = write!(
                s,
                "  proxy {:.1} µs/req ({} sys){}",
                cpu.us_per_req,
                percent(Some(cpu.system_share)),
                if cpu.clock == CpuClock::Ticks {
                    " [clock ticks]"
                } else {
                    ""
                }
            );
        }
        if self.all_errors() > 0 {
            let _ = write!(
                s,
                "  ERRORS {} ({})",
                self.all_errors(),
                self.first_error.as_deref().unwrap_or("?")
            );
        }
        s
    }

    fn json(&self) -> Value {
        json!({
            "via": self.via.name(),
            "mode": mode(self.stream),
            "concurrency": self.concurrency,
            "requests": self.ok,
            "errors": self.errors,
            "warmup_errors": self.warmup_errors,
            "first_error": self.first_error,
            "elapsed_s": self.elapsed_s,
            "throughput_rps": self.throughput,
            "latency_p50_ms": self.p50_ms,
            "latency_p99_ms": self.p99_ms,
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p99_ms": self.ttft_p99_ms,
            "proxy_cpu_us_per_req": self.proxy_cpu.map(|c| c.us_per_req).filter(|v| v.is_finite()),
            "proxy_cpu_clock": self.proxy_cpu.map(|c| c.clock.as_str()),
            "proxy_cpu_system_share": self
                .proxy_cpu
                .map(|c| c.system_share)
                .filter(|v| v.is_finite()),
            "bench_cpu_us_per_req": Some(self.bench_cpu_us).filter(|v| v.is_finite()),
        })
    }
}

/// The held streams.
#[derive(Debug, Clone)]
pub(crate) struct HoldStats {
    /// Streams started.
    pub(crate) streams: usize,
    /// The most open at once.
    pub(crate) max_open: usize,
    /// Streams open in the sample `during_rss_kib` was taken from.
    pub(crate) sampled_open: usize,
    /// VmRSS of the hold proxy after its warm-up.
    pub(crate) idle_rss_kib: u64,
    /// VmRSS with `sampled_open` streams open.
    pub(crate) during_rss_kib: u64,
    /// When that sample was taken, from the start of the streams.
    pub(crate) sampled_at: Duration,
    /// VmHWM of the hold proxy afterwards.
    pub(crate) hwm_kib: u64,
    pub(crate) ok: u64,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
    /// Median duration of a held stream.
    pub(crate) stream_p50_ms: Option<f64>,
}

impl HoldStats {
    /// (RSS during − RSS idle) / streams open, KiB.
    pub(crate) fn per_stream_kib(&self) -> Option<f64> {
        (self.sampled_open > 0).then(|| {
            (self.during_rss_kib as f64 - self.idle_rss_kib as f64) / self.sampled_open as f64
        })
    }
}

/// The proxy's memory.
#[derive(Debug, Clone)]
pub(crate) struct MemoryStats {
    /// VmRSS of the measured proxy after start-up and warm-up.
    pub(crate) idle_rss_kib: u64,
    /// VmHWM of the measured proxy after every phase.
    pub(crate) peak_rss_kib: u64,
    /// VmRSS of the floor proxy after start-up and warm-up (`--floor`).
    pub(crate) floor_idle_rss_kib: Option<u64>,
    pub(crate) hold: HoldStats,
}

/// The KV handoffs the engines saw, against the ones the proxies claimed.
///
/// `x-disagg-handoff: kv` is the proxy's own word. Each request it marks so must have
/// made the prefill answer `kv_transfer_params` and serve one pull over its side
/// channel, and made the decode engine pull the KV (`remote_decodes`) instead of
/// computing the prompt itself (`local_prefills`, which only the direct requests may
/// add to). The engines' counters are read once every request has been answered.
#[derive(Debug, Clone)]
pub(crate) struct HandoffCheck {
    /// Answers of the measured proxy (warm-ups included) marked `kv`.
    pub(crate) marked_kv: u64,
    /// Answers of the floor proxy (warm-ups included) marked `kv`; it shares the
    /// measured proxy's engines.
    pub(crate) floor_marked_kv: u64,
    /// Answers of the held-streams proxy marked `kv`.
    pub(crate) hold_marked_kv: u64,
    /// Requests sent straight to the decode engine (the baseline phases).
    pub(crate) direct_sent: u64,
    /// The prefill engine's counters (both proxies share it).
    pub(crate) prefill: disagg_sim::Stats,
    /// The decode engine behind the measured proxy (and the direct phases).
    pub(crate) decode: disagg_sim::Stats,
    /// The slow decode engine behind the held-streams proxy.
    pub(crate) slow_decode: disagg_sim::Stats,
}

impl HandoffCheck {
    /// Every way the engines' counts differ from the proxies' claims; empty when they
    /// agree.
    pub(crate) fn mismatches(&self) -> Vec<String> {
        let marked = self.marked_kv + self.floor_marked_kv + self.hold_marked_kv;
        let (p, d, slow) = (&self.prefill, &self.decode, &self.slow_decode);
        let mut out = Vec::new();
        let mut check = |what: &str, seen: u64, claimed: u64| {
            if seen != claimed {
                out.push(format!(
                    "{what}: the engines counted {seen}, the proxies' answers imply {claimed}"
                ));
            }
        };
        check(
            "prefill answers with kv_transfer_params",
            p.kv_params_returned,
            marked,
        );
        check(
            "prefill side-channel pulls served",
            p.side_channel_served,
            marked,
        );
        check(
            // The floor shares the measured proxy's decode engine.
            "decode KV pulls (measured proxy)",
            d.remote_decodes,
            self.marked_kv + self.floor_marked_kv,
        );
        check(
            "decode KV pulls (held streams)",
            slow.remote_decodes,
            self.hold_marked_kv,
        );
        // A proxied request that the decode computed itself, or a direct one it did not.
        check(
            "decode local prefills (only the direct requests)",
            d.local_prefills,
            self.direct_sent,
        );
        check("slow decode local prefills", slow.local_prefills, 0);
        check("KV blocks still held by the prefill", p.blocks_held, 0);
        out
    }
}

/// Everything a run measured.
#[derive(Debug, Clone)]
pub(crate) struct Report {
    pub(crate) config: RunConfig,
    pub(crate) phases: Vec<PhaseStats>,
    pub(crate) memory: MemoryStats,
    pub(crate) handoffs: HandoffCheck,
}

/// A target of the issue.
struct Target {
    name: &'static str,
    /// `≤` when true, `≥` when false.
    at_most: bool,
    limit: f64,
    unit: &'static str,
    value: Option<f64>,
}

impl Target {
    fn pass(&self) -> Option<bool> {
        let v = self.value.filter(|v| v.is_finite())?;
        Some(if self.at_most {
            v <= self.limit
        } else {
            v >= self.limit
        })
    }
}

impl Report {
    /// Failed requests, warm-ups and held streams included.
    pub(crate) fn errors(&self) -> u64 {
        self.phases.iter().map(PhaseStats::all_errors).sum::<u64>() + self.memory.hold.errors
    }

    /// Whether the figures can be trusted: no request failed, and the engines saw the
    /// KV handoffs the proxies claimed.
    pub(crate) fn valid(&self) -> bool {
        self.errors() == 0 && self.handoffs.mismatches().is_empty()
    }

    fn phase(&self, via: Via, stream: bool, concurrency: usize) -> Option<&PhaseStats> {
        self.phases
            .iter()
            .find(|p| p.via == via && p.stream == stream && p.concurrency == concurrency)
    }

    /// Proxy p50 − direct p50 at concurrency 1, ms.
    fn added_p50_ms(&self, stream: bool) -> Option<f64> {
        let d = self.phase(Via::Direct, stream, 1)?.p50_ms?;
        let p = self.phase(Via::Proxy, stream, 1)?.p50_ms?;
        Some(p - d)
    }

    /// Proxy TTFT p50 − direct TTFT p50 at concurrency 1, ms.
    fn added_ttft_p50_ms(&self, stream: bool) -> Option<f64> {
        let d = self.phase(Via::Direct, stream, 1)?.ttft_p50_ms?;
        let p = self.phase(Via::Proxy, stream, 1)?.ttft_p50_ms?;
        Some(p - d)
    }

    /// disagg / floor at concurrency 64: proxy CPU per request, and throughput.
    fn floor_ratios(&self, stream: bool) -> Option<(f64, f64)> {
        let c = THROUGHPUT_CONCURRENCY;
        let p = self.phase(Via::Proxy, stream, c)?;
        let f = self.phase(Via::Floor, stream, c)?;
        let cpu = p.proxy_cpu?.us_per_req / f.proxy_cpu?.us_per_req;
        Some((cpu, p.throughput / f.throughput))
    }

    fn targets(&self) -> Vec<Target> {
        let c = THROUGHPUT_CONCURRENCY;
        let cpu = |stream| Some(self.phase(Via::Proxy, stream, c)?.proxy_cpu?.us_per_req);
        let rps = |stream| Some(self.phase(Via::Proxy, stream, c)?.throughput);
        let mut targets = vec![
            Target {
                name: "proxy CPU per request, non-streaming (c=64)",
                at_most: true,
                limit: 60.0,
                unit: "µs",
                value: cpu(false),
            },
            Target {
                name: "proxy CPU per request, streaming (c=64)",
                at_most: true,
                limit: 120.0,
                unit: "µs",
                value: cpu(true),
            },
            Target {
                name: "added p50 over direct, non-streaming (c=1)",
                at_most: true,
                limit: 0.15,
                unit: "ms",
                value: self.added_p50_ms(false),
            },
            Target {
                name: "added p50 over direct, streaming (c=1)",
                at_most: true,
                limit: 0.25,
                unit: "ms",
                value: self.added_p50_ms(true),
            },
            Target {
                name: "throughput, non-streaming (c=64)",
                at_most: false,
                limit: 15_000.0,
                unit: "req/s",
                value: rps(false),
            },
            Target {
                name: "throughput, streaming (c=64)",
                at_most: false,
                limit: 6_000.0,
                unit: "req/s",
                value: rps(true),
            },
            Target {
                name: "proxy idle RSS",
                at_most: true,
                limit: 20.0,
                unit: "MiB",
                value: Some(mib(self.memory.idle_rss_kib)),
            },
            Target {
                name: "proxy memory per held stream",
                at_most: true,
                limit: 16.0,
                unit: "KiB",
                value: self.memory.hold.per_stream_kib(),
            },
        ];
        if self.phases.iter().any(|p| p.via == Via::Floor) {
            let ratio = |stream| self.floor_ratios(stream);
            targets.extend([
                Target {
                    name: "proxy CPU / floor CPU, non-streaming (c=64)",
                    at_most: true,
                    limit: 1.25,
                    unit: "×",
                    value: ratio(false).map(|r| r.0),
                },
                Target {
                    name: "proxy CPU / floor CPU, streaming (c=64)",
                    at_most: true,
                    limit: 1.25,
                    unit: "×",
                    value: ratio(true).map(|r| r.0),
                },
                Target {
                    name: "throughput / floor's, non-streaming (c=64)",
                    at_most: false,
                    limit: 0.95,
                    unit: "×",
                    value: ratio(false).map(|r| r.1),
                },
            ]);
        }
        targets
    }

    /// The printed report.
    pub(crate) fn table(&self) -> String {
        let c = &self.config;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "\ndisagg-bench: {} CPUs ({}), {:.1} GiB RAM; proxy process {} threads, engines {} \
             threads, load generator {} threads (engines and load generator share the bench \
             process)",
            c.cpus,
            c.cpu_model,
            c.mem_total_kib as f64 / (1024.0 * 1024.0),
            c.proxy_threads,
            c.engine_threads,
            c.client_threads,
        );
        let _ = writeln!(
            s,
            "chat completions, {} B body{}, {} tokens; {:.1} s per phase after {:.1} s warm-up \
             (at most {} requests); 1 prefill + 1 decode engine, round-robin, zero delay; \
             proxy CPU from the scheduler's ns per thread (schedstat; clock ticks, {} \
             ticks/s{}, for the system share and where a thread ended)",
            c.body_bytes,
            if c.images > 0 {
                format!(", {} images (E/P/D: 1 encoder)", c.images)
            } else {
                String::new()
            },
            c.tokens,
            c.duration.as_secs_f64(),
            c.warmup.as_secs_f64(),
            c.max_requests,
            c.ticks_per_sec,
            if c.ticks_read {
                " (getconf CLK_TCK)"
            } else {
                " (assumed)"
            },
        );
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "{:<6}  {:<10}  {:>4}  {:>9}  {:>7}  {:>7}  {:>8}  {:>8}  {:>9}  {:>5}  {:>9}  {:>6}",
            "via",
            "mode",
            "conc",
            "req/s",
            "p50 ms",
            "p99 ms",
            "TTFT p50",
            "TTFT p99",
            "proxy CPU",
            "(sys)",
            "bench CPU",
            "errors"
        );
        let _ = writeln!(
            s,
            "{:<6}  {:<10}  {:>4}  {:>9}  {:>7}  {:>7}  {:>8}  {:>8}  {:>9}  {:>5}  {:>9}  {:>6}",
            "", "", "", "", "", "", "ms", "ms", "µs/req", "", "µs/req", ""
        );
        for p in &self.phases {
            let _ = writeln!(
                s,
                "{:<6}  {:<10}  {:>4}  {:>9}  {:>7}  {:>7}  {:>8}  {:>8}  {:>9}  {:>5}  {:>9}  {:>6}",
                p.via.name(),
                mode(p.stream),
                p.concurrency,
                thousands(p.throughput),
                ms(p.p50_ms),
                ms(p.p99_ms),
                ms(p.ttft_p50_ms),
                ms(p.ttft_p99_ms),
                us(p.proxy_cpu.map(|c| c.us_per_req)),
                percent(p.proxy_cpu.map(|c| c.system_share)),
                us(Some(p.bench_cpu_us)),
                p.all_errors(),
            );
        }
        let by_ticks = self
            .phases
            .iter()
            .filter(|p| p.proxy_cpu.is_some_and(|c| c.clock == CpuClock::Ticks))
            .count();
        if by_ticks > 0 {
            let _ = writeln!(
                s,
                "proxy CPU of {by_ticks} phase(s) read from clock ticks (a proxy thread ended \
                 during the phase, or no schedstat): 10 ms steps"
            );
        }
        let _ = writeln!(s);
        for stream in [false, true] {
            let _ = writeln!(
                s,
                "added by the proxy at c=1, {:<10}: p50 {} ms, TTFT p50 {} ms",
                mode(stream),
                ms(self.added_p50_ms(stream)),
                ms(self.added_ttft_p50_ms(stream)),
            );
        }
        for stream in [false, true] {
            if let Some((cpu, rps)) = self.floor_ratios(stream) {
                let _ = writeln!(
                    s,
                    "disagg / floor at c={}, {:<10}: CPU per request {cpu:.2}×, throughput \
                     {rps:.2}×",
                    THROUGHPUT_CONCURRENCY,
                    mode(stream),
                );
            }
        }
        let m = &self.memory;
        let h = &m.hold;
        let _ = writeln!(
            s,
            "proxy memory: idle RSS {:.1} MiB, peak RSS (VmHWM) {:.1} MiB after every phase",
            mib(m.idle_rss_kib),
            mib(m.peak_rss_kib),
        );
        if let Some(f) = m.floor_idle_rss_kib {
            let _ = writeln!(s, "floor memory: idle RSS {:.1} MiB", mib(f));
        }
        let _ = writeln!(
            s,
            "held streams: {} started ({} open at most; {:.0} ms × {} tokens each, p50 {} ms) \
             through a second proxy process: RSS {:.1} MiB with {} open (at {:.0} ms) vs {:.1} \
             MiB idle → {} KiB per stream; VmHWM {:.1} MiB",
            h.streams,
            h.max_open,
            c.stream_delay.as_secs_f64() * 1e3,
            c.tokens,
            ms(h.stream_p50_ms),
            mib(h.during_rss_kib),
            h.sampled_open,
            h.sampled_at.as_secs_f64() * 1e3,
            mib(h.idle_rss_kib),
            h.per_stream_kib()
                .map_or_else(|| "-".to_owned(), |v| format!("{v:.1}")),
            mib(h.hwm_kib),
        );
        if h.sampled_open < h.streams {
            let _ = writeln!(
                s,
                "  note: never all {} streams open in one sample; the figure is over {}",
                h.streams, h.sampled_open
            );
        }

        let _ = writeln!(s, "\ntargets");
        for t in self.targets() {
            let value = match t.value.filter(|v| v.is_finite()) {
                Some(v) if t.unit == "req/s" => format!("{} {}", thousands(v), t.unit),
                Some(v) if t.unit == "ms" || t.unit == "×" => format!("{v:.3} {}", t.unit),
                Some(v) => format!("{v:.1} {}", t.unit),
                None => "n/a".to_owned(),
            };
            let limit = if t.unit == "req/s" {
                thousands(t.limit)
            } else {
                format!("{}", t.limit)
            };
            let verdict = match t.pass() {
                Some(true) => "PASS",
                Some(false) => "MISS",
                None => "n/a",
            };
            let _ = writeln!(
                s,
                "  {:<45} {} {:>6} {:<5}  {:>14}  {}",
                t.name,
                if t.at_most { "≤" } else { "≥" },
                limit,
                t.unit,
                value,
                verdict
            );
        }
        let hc = &self.handoffs;
        let _ = writeln!(
            s,
            "\nKV handoffs: the proxies marked {} answers `kv` ({} + {} floor + {} held \
             streams); the prefill returned kv_transfer_params {} times and served {} pulls; \
             the decodes pulled {} + {} and computed {} prompts themselves ({} direct \
             requests)",
            hc.marked_kv + hc.floor_marked_kv + hc.hold_marked_kv,
            hc.marked_kv,
            hc.floor_marked_kv,
            hc.hold_marked_kv,
            hc.prefill.kv_params_returned,
            hc.prefill.side_channel_served,
            hc.decode.remote_decodes,
            hc.slow_decode.remote_decodes,
            hc.decode.local_prefills + hc.slow_decode.local_prefills,
            hc.direct_sent,
        );
        let mismatches = hc.mismatches();
        for m in &mismatches {
            let _ = writeln!(s, "FLAGGED: {m}");
        }
        if mismatches.is_empty() {
            let _ = writeln!(s, "the engines saw every KV handoff the proxies claimed");
        }
        let errors = self.errors();
        if errors > 0 {
            let first = self
                .phases
                .iter()
                .filter_map(|p| p.first_error.as_deref())
                .chain(h.first_error.as_deref())
                .next()
                .unwrap_or("?");
            let _ = writeln!(
                s,
                "\nFLAGGED: {errors} request(s) failed during this run; its figures are suspect. \
                 First error: {first}"
            );
        } else {
            let _ = writeln!(s, "\nno request failed");
        }
        s
    }

    /// Every figure, for tracking.
    pub(crate) fn json(&self) -> Value {
        let c = &self.config;
        let m = &self.memory;
        let h = &m.hold;
        let unix_time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let over_floor: Vec<Value> = [false, true]
            .into_iter()
            .filter_map(|stream| {
                let (cpu, rps) = self.floor_ratios(stream)?;
                Some(json!({
                    "mode": mode(stream),
                    "cpu_per_request": cpu,
                    "throughput": rps,
                }))
            })
            .collect();
        let targets: Vec<Value> = self
            .targets()
            .iter()
            .map(|t| {
                json!({
                    "name": t.name,
                    "comparison": if t.at_most { "<=" } else { ">=" },
                    "limit": t.limit,
                    "unit": t.unit,
                    "value": t.value.filter(|v| v.is_finite()),
                    "pass": t.pass(),
                })
            })
            .collect();
        json!({
            "schema": 1,
            "unix_time": unix_time,
            "machine": {
                "cpus": c.cpus,
                "cpu_model": c.cpu_model,
                "mem_total_kib": c.mem_total_kib,
            },
            "config": {
                "duration_s": c.duration.as_secs_f64(),
                "warmup_s": c.warmup.as_secs_f64(),
                "max_requests": c.max_requests,
                "proxy_threads": c.proxy_threads,
                "engine_threads": c.engine_threads,
                "client_threads": c.client_threads,
                "body_bytes": c.body_bytes,
                "images": c.images,
                "tokens": c.tokens,
                "latency_concurrency": LATENCY_CONCURRENCY,
                "throughput_concurrency": THROUGHPUT_CONCURRENCY,
                "held_streams": c.streams,
                "held_stream_inter_token_ms": c.stream_delay.as_secs_f64() * 1e3,
                "clk_tck": c.ticks_per_sec,
                "clk_tck_source": if c.ticks_read { "getconf" } else { "assumed" },
            },
            "phases": self.phases.iter().map(PhaseStats::json).collect::<Vec<_>>(),
            "disagg_over_floor": over_floor,
            "added_p50_ms": {
                "non_stream": self.added_p50_ms(false),
                "stream": self.added_p50_ms(true),
            },
            "added_ttft_p50_ms": {
                "non_stream": self.added_ttft_p50_ms(false),
                "stream": self.added_ttft_p50_ms(true),
            },
            "memory": {
                "idle_rss_kib": m.idle_rss_kib,
                "peak_rss_kib": m.peak_rss_kib,
                "floor_idle_rss_kib": m.floor_idle_rss_kib,
                "held_streams": {
                    "started": h.streams,
                    "max_open": h.max_open,
                    "sampled_open": h.sampled_open,
                    "idle_rss_kib": h.idle_rss_kib,
                    "during_rss_kib": h.during_rss_kib,
                    "sampled_at_ms": h.sampled_at.as_secs_f64() * 1e3,
                    "hwm_kib": h.hwm_kib,
                    "per_stream_kib": h.per_stream_kib(),
                    "ok": h.ok,
                    "errors": h.errors,
                    "first_error": h.first_error,
                    "stream_p50_ms": h.stream_p50_ms,
                },
            },
            "targets": targets,
            "handoffs": {
                "marked_kv": self.handoffs.marked_kv,
                "floor_marked_kv": self.handoffs.floor_marked_kv,
                "hold_marked_kv": self.handoffs.hold_marked_kv,
                "direct_sent": self.handoffs.direct_sent,
                "prefill_kv_params_returned": self.handoffs.prefill.kv_params_returned,
                "prefill_side_channel_served": self.handoffs.prefill.side_channel_served,
                "prefill_blocks_held": self.handoffs.prefill.blocks_held,
                "decode_remote_decodes": self.handoffs.decode.remote_decodes,
                "decode_local_prefills": self.handoffs.decode.local_prefills,
                "slow_decode_remote_decodes": self.handoffs.slow_decode.remote_decodes,
                "slow_decode_local_prefills": self.handoffs.slow_decode.local_prefills,
                "mismatches": self.handoffs.mismatches(),
            },
            "errors": self.errors(),
            "valid": self.valid(),
        })
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn ms(v: Option<f64>) -> String {
    v.filter(|v| v.is_finite())
        .map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"))
}

fn us(v: Option<f64>) -> String {
    v.filter(|v| v.is_finite())
        .map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"))
}

fn percent(v: Option<f64>) -> String {
    v.filter(|v| v.is_finite())
        .map_or_else(|| "-".to_owned(), |v| format!("{:.0}%", v * 100.0))
}

/// `12345.6` → `"12,346"`.
fn thousands(v: f64) -> String {
    if !v.is_finite() {
        return "-".to_owned();
    }
    let digits = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    if v < 0.0 { format!("-{out}") } else { out }
}

#[cfg(test)]
mod tests {
    use super::{HandoffCheck, thousands};

    /// The counters of a run where 10 requests went straight to the decode, the measured
    /// proxy handed 30 over and the held-streams proxy 4.
    fn consistent() -> HandoffCheck {
        let stats = disagg_sim::Stats::default;
        HandoffCheck {
            marked_kv: 30,
            floor_marked_kv: 0,
            hold_marked_kv: 4,
            direct_sent: 10,
            prefill: disagg_sim::Stats {
                kv_params_returned: 34,
                side_channel_served: 34,
                ..stats()
            },
            decode: disagg_sim::Stats {
                remote_decodes: 30,
                local_prefills: 10,
                ..stats()
            },
            slow_decode: disagg_sim::Stats {
                remote_decodes: 4,
                ..stats()
            },
        }
    }

    #[test]
    fn engines_that_saw_every_claimed_handoff_agree() {
        assert_eq!(consistent().mismatches(), Vec::<String>::new());
    }

    #[test]
    fn a_claimed_handoff_the_engines_did_not_see_is_flagged() {
        // The proxy said `kv` but the decode computed the prompt itself (the prefill's
        // handoff went nowhere): three counters disagree.
        let mut c = consistent();
        c.prefill.side_channel_served -= 1;
        c.decode.remote_decodes -= 1;
        c.decode.local_prefills += 1;
        let m = c.mismatches();
        assert_eq!(m.len(), 3, "{m:?}");
        assert!(m[0].contains("side-channel pulls served"), "{m:?}");
        assert!(m[1].contains("decode KV pulls (measured proxy)"), "{m:?}");
        assert!(m[2].contains("decode local prefills"), "{m:?}");
        // KV left on the prefill (a handoff nobody pulled) is flagged as well.
        let mut c = consistent();
        c.prefill.blocks_held = 2;
        assert_eq!(c.mismatches().len(), 1);
    }

    #[test]
    fn the_floor_s_handoffs_count_with_the_measured_proxy_s() {
        // The floor handed 5 more over through the same prefill and decode.
        let mut c = consistent();
        c.floor_marked_kv = 5;
        assert_eq!(c.mismatches().len(), 3, "unseen floor claims are flagged");
        c.prefill.kv_params_returned += 5;
        c.prefill.side_channel_served += 5;
        c.decode.remote_decodes += 5;
        assert_eq!(c.mismatches(), Vec::<String>::new());
    }

    #[test]
    fn groups_thousands() {
        assert_eq!(thousands(0.4), "0");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(15_000.0), "15,000");
        assert_eq!(thousands(1_234_567.8), "1,234,568");
        assert_eq!(thousands(f64::NAN), "-");
    }
}
