//! The benchmark run: engines, proxy processes, phases, memory hold.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Args;
use disagg_sim::{SimConfig, SimEngine};
use http::Uri;

use crate::BoxError;
use crate::load::{self, Claims, Gauge, Hold, HttpClient, Outcome, Target};
use crate::procfs::{self, ProxyProcess};
use crate::report::{
    HandoffCheck, HoldStats, MemoryStats, PhaseStats, ProxyCpu, Report, RunConfig, Via,
};

/// The concurrencies of the latency phases.
pub(crate) const LATENCY_CONCURRENCY: [usize; 2] = [1, 16];
/// The concurrency of the throughput phase.
pub(crate) const THROUGHPUT_CONCURRENCY: usize = 64;

/// Flags of a benchmark run.
#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    /// Seconds each measured phase lasts (12 phases: direct and proxy, non-streaming and
    /// streaming, concurrency 1, 16 and 64).
    #[arg(long, value_name = "SECS", default_value_t = 3.0)]
    duration: f64,
    /// Seconds of warm-up (same load, not measured) before each measured phase.
    #[arg(long, value_name = "SECS", default_value_t = 0.5)]
    warmup: f64,
    /// Most requests sent in one measured phase (and in one warm-up); at least 64, the
    /// largest concurrency.
    #[arg(long, value_name = "N", default_value_t = 1_000_000)]
    max_requests: u64,
    /// Serving threads of the proxy process (and of the floor): one single-threaded
    /// event loop each, as `disagg-proxy serve --threads`.
    #[arg(long, value_name = "N", default_value_t = 2)]
    proxy_threads: usize,
    /// Tokio worker threads of the simulated engines' runtime (in the bench process).
    #[arg(long, value_name = "N", default_value_t = 2)]
    engine_threads: usize,
    /// Tokio worker threads of the load generator's runtime (in the bench process).
    #[arg(long, value_name = "N", default_value_t = 2)]
    client_threads: usize,
    /// Tokens generated per request (`max_tokens`).
    #[arg(long, value_name = "N", default_value_t = 16)]
    tokens: u32,
    /// Size of the chat request body, in bytes (the prompt is padded to it).
    #[arg(long, value_name = "BYTES", default_value_t = 256)]
    body_bytes: usize,
    /// Streams held open at once to measure the proxy's memory per stream.
    #[arg(long, value_name = "N", default_value_t = 256)]
    streams: usize,
    /// Time between two tokens of the decode engine behind the held streams, in ms.
    #[arg(long, value_name = "MS", default_value_t = 50.0)]
    stream_delay_ms: f64,
    /// Also measure the floor: the smallest correct NIXL proxy (the hidden `floor`
    /// subcommand, hyper and a top-level scan; see `floor.rs`), in a process of its own
    /// with `--proxy-threads` event-loop threads as the proxy's, phase by phase beside the
    /// disagg proxy; the report then gives disagg / floor.
    #[arg(long)]
    floor: bool,
    /// More flags for the disagg proxy processes, as one whitespace-separated string
    /// (for example `--proxy-args "--prompt-token-reuse off"`).
    #[arg(
        long,
        value_name = "FLAGS",
        default_value = "",
        allow_hyphen_values = true
    )]
    proxy_args: String,
    /// Image parts per request (E/P/D, issue #34): above 0, a simulated encoder-only
    /// engine joins (the proxy's `--encode`), the prefill consumes its output (vLLM's
    /// shared-storage EC connector), and every request carries this many small inline
    /// images, so each phase measures the encoder stage too; run it beside `--images 0`
    /// for the cost per image. Not with `--floor`, which has no encoder stage.
    #[arg(long, value_name = "K", default_value_t = 0, conflicts_with = "floor")]
    images: usize,
    /// Also write every figure as JSON to this file.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
}

fn secs(v: f64, flag: &str) -> Result<Duration, BoxError> {
    Duration::try_from_secs_f64(v)
        .map_err(|_| format!("--{flag} must be a non-negative number of seconds").into())
}

/// The engines, on the bench's engine runtime.
struct Engines {
    prefill: SimEngine,
    decode: SimEngine,
    /// A decode engine with an inter-token delay, for the held streams.
    slow_decode: SimEngine,
    /// With `--images`: the encoder-only engine and the directory it shares with the
    /// prefill (removed at the end).
    encoder: Option<(SimEngine, PathBuf)>,
}

/// Run the benchmark, print the table, write the JSON. `Ok(false)` when some request
/// failed: the figures are then suspect.
pub(crate) fn main(args: RunArgs) -> Result<bool, BoxError> {
    let duration = secs(args.duration, "duration")?;
    let warmup = secs(args.warmup, "warmup")?;
    let delay = Duration::try_from_secs_f64(args.stream_delay_ms / 1e3)
        .map_err(|_| "--stream-delay-ms must be a non-negative number")?;
    if duration.is_zero() {
        return Err("--duration must be positive".into());
    }
    if args.max_requests < THROUGHPUT_CONCURRENCY as u64 {
        return Err(format!(
            "--max-requests must be at least {THROUGHPUT_CONCURRENCY}, the largest \
             concurrency: with fewer, fewer clients would run than the phase says"
        )
        .into());
    }
    crate::proxy::check_proxy_args(&args.proxy_args.split_whitespace().collect::<Vec<_>>())?;
    let (ticks_per_sec, ticks_read) = procfs::clock_ticks();
    let (cpus, cpu_model, mem_total_kib) = procfs::machine();
    let config = RunConfig {
        duration,
        warmup,
        max_requests: args.max_requests,
        proxy_threads: args.proxy_threads.max(1),
        engine_threads: args.engine_threads.max(1),
        client_threads: args.client_threads.max(1),
        tokens: args.tokens,
        body_bytes: 0,
        images: args.images,
        streams: args.streams.max(1),
        stream_delay: delay,
        ticks_per_sec,
        ticks_read,
        cpus,
        cpu_model,
        mem_total_kib,
    };

    let engine_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.engine_threads)
        .thread_name("sim-engine")
        .enable_all()
        .build()?;
    let load_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.client_threads)
        .thread_name("load")
        .enable_all()
        .build()?;
    let engines = engine_rt.block_on(start_engines(
        config.tokens,
        delay,
        args.body_bytes,
        args.images,
    ))?;
    let result = load_rt.block_on(bench(config, &args, &engines));
    engine_rt.block_on(async {
        engines.prefill.shutdown().await;
        engines.decode.shutdown().await;
        engines.slow_decode.shutdown().await;
        if let Some((encoder, store)) = engines.encoder {
            encoder.shutdown().await;
            let _ = std::fs::remove_dir_all(store);
        }
    });
    load_rt.shutdown_timeout(Duration::from_secs(2));
    engine_rt.shutdown_timeout(Duration::from_secs(2));

    let report = result?;
    print!("{}", report.table());
    if let Some(path) = &args.json {
        let json = serde_json::to_vec_pretty(&report.json())?;
        std::fs::write(path, json).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!("figures written to {}", path.display());
    }
    Ok(report.valid())
}

async fn start_engines(
    tokens: u32,
    delay: Duration,
    body_bytes: usize,
    images: usize,
) -> Result<Engines, BoxError> {
    // A prompt has fewer tokens than bytes: a context as long as the body in bytes
    // (and never shorter than the engines' default) admits any `--body-bytes`.
    let max_model_len = u32::try_from(body_bytes)
        .unwrap_or(u32::MAX)
        .max(SimConfig::default().max_model_len)
        .saturating_add(tokens);
    let sim = |id: &str, inter_token_delay: Duration| SimConfig {
        engine_id: Some(id.to_owned()),
        default_max_tokens: tokens,
        inter_token_delay,
        record_requests: 0,
        max_model_len,
        ..SimConfig::default()
    };
    // E/P/D: the encoder writes each item's embeddings where the prefill reads them.
    let store = (images > 0)
        .then(|| std::env::temp_dir().join(format!("disagg-bench-ec-{}", std::process::id())));
    let ec = |role| {
        store.as_ref().map(|store| disagg_sim::EcConfig {
            role,
            store: store.clone(),
        })
    };
    if let Some(store) = &store {
        std::fs::create_dir_all(store)
            .map_err(|e| format!("cannot make {}: {e}", store.display()))?;
    }
    let encoder = match &store {
        Some(store) => Some((
            SimEngine::start(SimConfig {
                ec: ec(disagg_sim::EcRole::Producer),
                ..sim("encoder-0", Duration::ZERO)
            })
            .await?,
            store.clone(),
        )),
        None => None,
    };
    Ok(Engines {
        prefill: SimEngine::start(SimConfig {
            ec: ec(disagg_sim::EcRole::Consumer),
            ..sim("prefill-0", Duration::ZERO)
        })
        .await?,
        decode: SimEngine::start(sim("decode-0", Duration::ZERO)).await?,
        slow_decode: SimEngine::start(sim("decode-slow", delay)).await?,
        encoder,
    })
}

/// A chat request of `size` bytes (or the smallest possible), prompt padded with words,
/// with `images` small inline images after the text (each its own item).
fn chat_body(size: usize, tokens: u32, stream: bool, images: usize) -> Result<Bytes, BoxError> {
    const WORDS: &str = "Explain why splitting prefill and decode across engines helps serving \
                         large language models at scale, with the costs of moving the KV cache. ";
    let make = |text: &str| {
        let content = if images == 0 {
            serde_json::json!(text)
        } else {
            let mut parts = vec![serde_json::json!({"type": "text", "text": text})];
            parts.extend((0..images).map(|i| {
                serde_json::json!({"type": "image_url", "image_url": {
                    "url": format!("data:image/png;base64,iVBORw0KGgo{i:04}")}})
            }));
            serde_json::Value::Array(parts)
        };
        serde_json::to_vec(&serde_json::json!({
            "model": "sim-model",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": tokens,
            "stream": stream,
        }))
    };
    let empty = make("")?.len();
    let pad = size.saturating_sub(empty);
    let content: String = WORDS.chars().cycle().take(pad).collect();
    Ok(Bytes::from(make(&content)?))
}

fn chat_uri(base: &str) -> Result<Uri, BoxError> {
    Ok(format!("{base}/v1/chat/completions").parse()?)
}

async fn bench(
    mut config: RunConfig,
    args: &RunArgs,
    engines: &Engines,
) -> Result<Report, BoxError> {
    let bodies = [
        chat_body(args.body_bytes, config.tokens, false, args.images)?,
        chat_body(args.body_bytes, config.tokens, true, args.images)?,
    ];
    config.body_bytes = bodies[0].len();
    let client = load::client();
    let prefill = engines.prefill.url();
    let claims = PhaseClaims::default();
    let encode_url = engines.encoder.as_ref().map(|(e, _)| e.url());
    let mut extra: Vec<&str> = args.proxy_args.split_whitespace().collect();
    if let Some(url) = &encode_url {
        extra.extend(["--encode", url.as_str()]);
    }
    let mut proxy = ProxyProcess::spawn(
        &prefill,
        &engines.decode.url(),
        config.proxy_threads,
        &extra,
    )
    .await?;
    let mut floor = if args.floor {
        Some(
            ProxyProcess::spawn_floor(&prefill, &engines.decode.url(), config.proxy_threads)
                .await?,
        )
    } else {
        None
    };
    let measured = phases(
        &config,
        engines,
        &client,
        (&mut proxy, floor.as_mut()),
        &bodies,
        &claims,
    )
    .await;
    let stopped = proxy.stop().await;
    let floor_stopped = match floor {
        Some(f) => f.stop().await,
        None => Ok(()),
    };
    let (phases, idle, peak, floor_idle) = measured?;
    stopped?;
    floor_stopped?;

    let hold_claims = Arc::new(Claims::default());
    let hold_proxy = ProxyProcess::spawn(
        &prefill,
        &engines.slow_decode.url(),
        config.proxy_threads,
        &extra,
    )
    .await?;
    let mut hold_proxy = hold_proxy;
    let held = hold(&config, &client, &mut hold_proxy, &bodies[1], &hold_claims).await;
    let stopped = hold_proxy.stop().await;
    let hold = held?;
    stopped?;

    // Every request has been answered: the engines' counters are final.
    let handoffs = HandoffCheck {
        marked_kv: claims.proxy.kv(),
        floor_marked_kv: claims.floor.kv(),
        hold_marked_kv: hold_claims.kv(),
        direct_sent: claims.direct.sent(),
        prefill: engines.prefill.stats(),
        decode: engines.decode.stats(),
        slow_decode: engines.slow_decode.stats(),
    };
    Ok(Report {
        config,
        phases,
        memory: MemoryStats {
            idle_rss_kib: idle.rss_kib,
            peak_rss_kib: peak.hwm_kib,
            floor_idle_rss_kib: floor_idle.map(|m| m.rss_kib),
            hold,
        },
        handoffs,
    })
}

/// The claims of the main proxy's phases: through the proxy, through the floor, and
/// straight to the decode engine.
#[derive(Debug, Default)]
struct PhaseClaims {
    proxy: Arc<Claims>,
    floor: Arc<Claims>,
    direct: Arc<Claims>,
}

/// What [`phases`] measured: the phases, the proxy's idle and peak memory, the floor's
/// idle memory.
type Measured = (
    Vec<PhaseStats>,
    procfs::Memory,
    procfs::Memory,
    Option<procfs::Memory>,
);

/// Warm up the proxy (and the floor), read their idle memory, then run every phase; the
/// proxy's peak memory at the end.
async fn phases(
    config: &RunConfig,
    engines: &Engines,
    client: &HttpClient,
    (proxy, mut floor): (&mut ProxyProcess, Option<&mut ProxyProcess>),
    bodies: &[Bytes; 2],
    claims: &PhaseClaims,
) -> Result<Measured, BoxError> {
    let direct = chat_uri(&engines.decode.url())?;
    let through = chat_uri(&format!("http://{}", proxy.addr()))?;
    let floor_uri = match &floor {
        Some(f) => Some(chat_uri(&format!("http://{}", f.addr()))?),
        None => None,
    };
    let target = |via: Via, stream: bool| Target {
        uri: match via {
            Via::Direct => direct.clone(),
            Via::Proxy => through.clone(),
            Via::Floor => floor_uri.clone().unwrap_or_else(|| through.clone()),
        },
        body: bodies[usize::from(stream)].clone(),
        stream,
        expect_kv: via != Via::Direct,
        claims: match via {
            Via::Direct => Arc::clone(&claims.direct),
            Via::Proxy => Arc::clone(&claims.proxy),
            Via::Floor => Arc::clone(&claims.floor),
        },
    };
    let me = std::process::id();
    let measured_vias: &[Via] = if floor.is_some() {
        &[Via::Direct, Via::Proxy, Via::Floor]
    } else {
        &[Via::Direct, Via::Proxy]
    };

    // Start-up warm-up at concurrency 1, then the idle figures.
    let mut startup_errors = 0;
    for via in &measured_vias[1..] {
        for stream in [false, true] {
            let out = load::run(
                client,
                &target(*via, stream),
                1,
                config.warmup,
                config.max_requests,
                None,
            )
            .await?;
            startup_errors += out.errors;
            if let Some(e) = out.first_error {
                eprintln!("warm-up error: {e}");
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let idle = proxy.memory()?;
    eprintln!(
        "proxy pid {} on {}: idle RSS {:.1} MiB after warm-up",
        proxy.pid(),
        proxy.addr(),
        idle.rss_kib as f64 / 1024.0
    );
    let floor_idle = match floor.as_deref_mut() {
        Some(f) => {
            let m = f.memory()?;
            eprintln!(
                "floor pid {}: idle RSS {:.1} MiB after warm-up",
                f.pid(),
                m.rss_kib as f64 / 1024.0
            );
            Some(m)
        }
        None => None,
    };

    let mut phases = Vec::new();
    for stream in [false, true] {
        let concurrencies = LATENCY_CONCURRENCY
            .iter()
            .copied()
            .chain([THROUGHPUT_CONCURRENCY]);
        for concurrency in concurrencies {
            for &via in measured_vias {
                let t = target(via, stream);
                let warm = load::run(
                    client,
                    &t,
                    concurrency,
                    config.warmup,
                    config.max_requests,
                    None,
                )
                .await?;
                let measured = match (via, floor.as_deref_mut()) {
                    (Via::Floor, Some(f)) => &mut *f,
                    _ => &mut *proxy,
                };
                let proxy0 = measured.cpu()?;
                let me0 = procfs::cpu_ticks(me)?;
                let out = load::run(
                    client,
                    &t,
                    concurrency,
                    config.duration,
                    config.max_requests,
                    None,
                )
                .await?;
                let measured = match (via, floor.as_deref_mut()) {
                    (Via::Floor, Some(f)) => &mut *f,
                    _ => &mut *proxy,
                };
                // The scheduler's nanoseconds when they account for every thread's
                // time; the ticks' 10 ms steps otherwise.
                let used = measured.cpu()?.since(&proxy0, config.ticks_per_sec);
                let me_ticks = procfs::cpu_ticks(me)?.since(me0);
                proxy.check_alive()?;
                if let Some(f) = floor.as_deref_mut() {
                    f.check_alive()?;
                }
                let mut warmup_errors = warm.errors;
                if phases.is_empty() {
                    warmup_errors += startup_errors;
                }
                let stats = PhaseStats::new(
                    via,
                    stream,
                    concurrency,
                    &out,
                    warm.first_error,
                    warmup_errors,
                    (via != Via::Direct).then(|| ProxyCpu {
                        us_per_req: per_request_us(used.secs, &out),
                        clock: used.clock,
                        system_share: share(used.ticks.system, used.ticks.total()),
                    }),
                    per_request_us(ticks_secs(me_ticks.total(), config), &out),
                );
                eprintln!("{}", stats.progress_line());
                phases.push(stats);
            }
        }
    }
    let peak = proxy.memory()?;
    Ok((phases, idle, peak, floor_idle))
}

/// Seconds of CPU in `ticks` clock ticks.
fn ticks_secs(ticks: u64, config: &RunConfig) -> f64 {
    ticks as f64 / config.ticks_per_sec
}

/// CPU µs per successful request from CPU seconds.
fn per_request_us(secs: f64, out: &Outcome) -> f64 {
    if out.ok == 0 {
        return f64::NAN;
    }
    secs / out.ok as f64 * 1e6
}

/// `part / total`, `NaN` when `total` is 0.
fn share(part: u64, total: u64) -> f64 {
    if total == 0 {
        f64::NAN
    } else {
        part as f64 / total as f64
    }
}

/// Hold `config.streams` streams open through `proxy` (whose decode engine is slow),
/// sampling its memory.
async fn hold(
    config: &RunConfig,
    client: &HttpClient,
    proxy: &mut ProxyProcess,
    body: &Bytes,
    claims: &Arc<Claims>,
) -> Result<HoldStats, BoxError> {
    let target = Target {
        uri: chat_uri(&format!("http://{}", proxy.addr()))?,
        body: body.clone(),
        stream: true,
        expect_kv: true,
        claims: Arc::clone(claims),
    };
    let stream_time = config.stream_delay.saturating_mul(config.tokens.max(1));
    let window = stream_time * 2 + Duration::from_secs(5);

    // Warm-up: a few streams, as the idle figure of the main proxy.
    let warm = load::run(client, &target, 4, window, 4, None).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let idle = proxy.memory()?;

    let gauge = Arc::new(Gauge::default());
    let streams = config.streams;
    // Streams are started over a quarter of a stream's time rather than at one
    // instant: the figure is memory per open stream, not how the proxy takes a burst
    // of connections.
    let stagger = (stream_time / 4) / u32::try_from(streams).unwrap_or(u32::MAX);
    let started = Instant::now();
    let task = {
        let client = client.clone();
        let target = target.clone();
        let hold = Hold {
            gauge: gauge.clone(),
            stagger,
        };
        tokio::spawn(async move {
            load::run(
                &client,
                &target,
                streams,
                window,
                streams as u64,
                Some(hold),
            )
            .await
        })
    };
    // The sample with the most streams open, the largest RSS among those.
    let mut best = (0usize, idle.rss_kib, Duration::ZERO);
    let mut ticker = tokio::time::interval(Duration::from_millis(5));
    let sampled: Result<(), BoxError> = async {
        while !task.is_finished() {
            ticker.tick().await;
            let open = gauge.open();
            let rss = proxy.memory()?.rss_kib;
            if (open, rss) > (best.0, best.1) {
                best = (open, rss, started.elapsed());
            }
        }
        Ok(())
    }
    .await;
    if let Err(e) = sampled {
        task.abort();
        return Err(e);
    }
    let out = task.await??;
    let after = proxy.memory()?;
    let (open, during, at) = best;
    Ok(HoldStats {
        streams,
        max_open: gauge.max(),
        sampled_open: open,
        idle_rss_kib: idle.rss_kib,
        during_rss_kib: during,
        sampled_at: at,
        hwm_kib: after.hwm_kib,
        ok: out.ok,
        errors: out.errors + warm.errors,
        first_error: out.first_error.or(warm.first_error),
        stream_p50_ms: load::quantile_ms(&out.latency_ns, 0.5),
    })
}
