//! `disagg-bench hold`: stranded KV under saturated decodes, with the proxy's decode
//! admission hold off and on (`--decode-admission-wait` with `--decode-max-running`).
//!
//! One simulated vLLM NIXL prefill, whose unclaimed KV expires after `--kv-lease`, and
//! one simulated decode that runs at most `--max-num-seqs` requests at once (vLLM's
//! `--max-num-seqs`): the others wait in its queue, and it pulls a request's KV only
//! when the request runs. `--clients` clients send `--requests` chat requests, each
//! generating `--tokens` tokens `--inter-token-ms` apart, so the decode is saturated.
//!
//! Without the hold, every request's prefill runs at once, and its KV waits on the
//! prefill for the decode's queue: past the lease it expires, and the decode's pull
//! fails (the engines count it: `nixl_num_kv_expired_reqs` on the prefill, a failed
//! pull on the decode). With the hold, a request's prefill is sent only when the
//! decode runs fewer than `--max-num-seqs` requests, so its KV is pulled at once.
//! Each mode runs on fresh engines and its own proxy process.
//!
//! Run: `cargo run --release -p disagg-bench -- hold [--clients 24] [--requests 240]
//! [--max-num-seqs 4] [--tokens 16] [--inter-token-ms 20] [--kv-lease 1.5]
//! [--timeout SECS] [--proxy-args "--load-source engine-metrics"]`.

use std::time::Duration;

use clap::Args;
use disagg_sim::{KvMode, SimConfig, SimEngine, Stats};

use crate::BoxError;
use crate::load::{self, Claims, Target, quantile_ms};
use crate::procfs::ProxyProcess;

/// `disagg-bench hold`'s flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct HoldArgs {
    /// Clients sending at once.
    #[arg(long, default_value_t = 24)]
    clients: usize,
    /// Requests in all, per mode.
    #[arg(long, default_value_t = 240)]
    requests: u64,
    /// The decode's running limit (vLLM's --max-num-seqs), also given to the proxy as
    /// --decode-max-running when the hold is on.
    #[arg(long, default_value_t = 4)]
    max_num_seqs: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 16)]
    tokens: u32,
    /// Time between generated tokens on the decode, in milliseconds.
    #[arg(long, default_value_t = 20)]
    inter_token_ms: u64,
    /// How long the prefill holds KV nobody pulled, in seconds (vLLM's abort timeout,
    /// 480 s by default, shortened so that a run shows the expiry).
    #[arg(long, default_value_t = 1.5)]
    kv_lease: f64,
    /// The hold's --decode-admission-wait, in seconds.
    #[arg(long, default_value_t = 120.0)]
    wait: f64,
    /// Seconds within which a mode must have sent every request (the last answers get
    /// 15 s more), or the run fails. Default: twice the decode's own time for the work
    /// (`--requests` / `--max-num-seqs` rounds of `--tokens` × `--inter-token-ms`),
    /// plus 30 s.
    #[arg(long, value_name = "SECS")]
    timeout: Option<f64>,
    /// Proxy worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// More flags for the proxy in both modes, space-separated (e.g. `--load-source
    /// engine-metrics`).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    proxy_args: String,
}

/// What one mode measured.
#[derive(Debug)]
struct Measured {
    outcome: load::Outcome,
    prefill: Stats,
    decode: Stats,
}

impl HoldArgs {
    /// How long a mode may take to send its requests: `--timeout`, or what the
    /// workload needs on the decode, twice, plus 30 s.
    fn timeout(&self) -> Result<Duration, BoxError> {
        if let Some(secs) = self.timeout {
            return Duration::try_from_secs_f64(secs)
                .map_err(|e| format!("--timeout {secs}: {e}").into());
        }
        let rounds = self
            .requests
            .div_ceil(u64::try_from(self.max_num_seqs.max(1)).unwrap_or(u64::MAX));
        let per_round =
            Duration::from_millis(self.inter_token_ms).saturating_mul(self.tokens.max(1));
        let work = per_round.saturating_mul(u32::try_from(rounds).unwrap_or(u32::MAX));
        Ok(work
            .saturating_mul(2)
            .saturating_add(Duration::from_secs(30)))
    }
}

pub(crate) fn main(args: HoldArgs) -> Result<bool, BoxError> {
    let lease = Duration::try_from_secs_f64(args.kv_lease)
        .map_err(|e| format!("--kv-lease {}: {e}", args.kv_lease))?;
    if args.max_num_seqs == 0 || args.clients == 0 || args.requests == 0 {
        return Err("--max-num-seqs, --clients and --requests must be at least 1".into());
    }
    if args.requests < args.clients as u64 {
        return Err(format!(
            "--requests ({}) must be at least --clients ({}): with fewer, fewer clients \
             would send than the run says",
            args.requests, args.clients
        )
        .into());
    }
    let timeout = args.timeout()?;
    crate::proxy::check_proxy_args(&args.proxy_args.split_whitespace().collect::<Vec<_>>())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        println!(
            "disagg-bench hold: {} clients, {} requests, decode --max-num-seqs {}, {} tokens \
             {} ms apart, prefill KV lease {:?}",
            args.clients, args.requests, args.max_num_seqs, args.tokens, args.inter_token_ms, lease
        );
        println!(
            "{:<5} {:>5} {:>6} {:>8} {:>10} {:>11} {:>10} {:>10} {:>10}",
            "hold",
            "ok",
            "failed",
            "req/s",
            "p50 ms",
            "p99 ms",
            "KV expired",
            "pull fail",
            "KV pulled"
        );
        let mut all_ok = true;
        for hold in [false, true] {
            let m = run(&args, lease, hold, timeout).await?;
            let o = &m.outcome;
            println!(
                "{:<5} {:>5} {:>6} {:>8.1} {:>10.1} {:>11.1} {:>10} {:>10} {:>10}",
                if hold { "on" } else { "off" },
                o.ok,
                o.errors,
                o.throughput(),
                quantile_ms(&o.latency_ns, 0.5).unwrap_or(f64::NAN),
                quantile_ms(&o.latency_ns, 0.99).unwrap_or(f64::NAN),
                m.prefill.kv_expired_reqs,
                m.decode.kv_pull_failures,
                m.decode.remote_decodes,
            );
            if let Some(e) = &o.first_error {
                println!("      first failure: {e}");
            }
            // The hold's claim: no KV stranded, nothing lost.
            all_ok &= !hold || (m.prefill.kv_expired_reqs == 0 && o.errors == 0);
        }
        if !all_ok {
            println!("the hold stranded KV or lost requests");
        }
        Ok(all_ok)
    })
}

async fn run(
    args: &HoldArgs,
    lease: Duration,
    hold: bool,
    timeout: Duration,
) -> Result<Measured, BoxError> {
    let prefill = SimEngine::start(SimConfig {
        engine_id: Some("prefill-0".into()),
        kv_mode: KvMode::Nixl,
        kv_lease: lease,
        record_requests: 0,
        ..SimConfig::default()
    })
    .await?;
    let decode = SimEngine::start(SimConfig {
        engine_id: Some("decode-0".into()),
        kv_mode: KvMode::Nixl,
        max_num_seqs: Some(args.max_num_seqs),
        inter_token_delay: Duration::from_millis(args.inter_token_ms),
        record_requests: 0,
        ..SimConfig::default()
    })
    .await?;
    let wait = args.wait.to_string();
    let running = args.max_num_seqs.to_string();
    let mut extra: Vec<&str> = args.proxy_args.split_whitespace().collect();
    if hold {
        extra.extend([
            "--decode-admission-wait",
            &wait,
            "--decode-max-running",
            &running,
        ]);
    }
    let proxy = ProxyProcess::spawn(&prefill.url(), &decode.url(), args.threads, &extra).await?;
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Why split prefill and decode?"}],
        "max_tokens": args.tokens,
    }))?;
    let target = Target {
        uri: format!("http://{}/v1/chat/completions", proxy.addr()).parse()?,
        body: body.into(),
        stream: false,
        expect_kv: true,
        claims: std::sync::Arc::new(Claims::default()),
    };
    let client = load::client();
    let outcome = load::run(&client, &target, args.clients, timeout, args.requests, None).await;
    let stopped = proxy.stop().await;
    let outcome = outcome?;
    stopped?;
    let sent = outcome.ok + outcome.errors;
    if sent < args.requests {
        return Err(format!(
            "the run with the hold {} did not finish within {:?} (--timeout): {sent} of {} \
             requests sent",
            if hold { "on" } else { "off" },
            timeout,
            args.requests
        )
        .into());
    }
    // Let every lease still running end, so that the prefill's count is final.
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    Ok(Measured {
        outcome,
        prefill: prefill.stats(),
        decode: decode.stats(),
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: HoldArgs,
    }

    fn parse(args: &[&str]) -> Result<HoldArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("hold").chain(args.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn the_default_timeout_follows_the_workload() -> Result<(), BoxError> {
        // 240 requests, 4 at a time, 16 tokens 20 ms apart: 60 rounds of 320 ms.
        let default = parse(&[])?.timeout()?;
        assert_eq!(
            default,
            Duration::from_millis(2 * 60 * 320) + Duration::from_secs(30)
        );
        let longer = parse(&["--requests", "2400"])?.timeout()?;
        assert_eq!(
            longer,
            Duration::from_millis(2 * 600 * 320) + Duration::from_secs(30)
        );
        assert_eq!(
            parse(&["--timeout", "2.5"])?.timeout()?,
            Duration::from_millis(2500)
        );
        assert!(parse(&["--timeout", "inf"])?.timeout().is_err());
        Ok(())
    }
}
