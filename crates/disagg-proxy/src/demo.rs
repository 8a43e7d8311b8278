//! `disagg-proxy demo`: one streaming chat request through the proxy, end to end, over
//! loopback sockets, against two simulated engines speaking the chosen connector's
//! protocol (`--connector nixl|sglang|mooncake|lmcache`).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Args;
use disagg_connectors::lmcache::{LmcacheReceiver, Notifications, NotifyConfig};
use disagg_connectors::vllm::rewrite::check::VllmLimits;
use disagg_core::endpoint::Facts;
use disagg_core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg_http::{HttpTransport, PdService};
use disagg_resilience::pairing::ValidatedSource;
use disagg_sim::{KvMode, SimConfig, SimEngine, SimRole};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;

use crate::BoxError;
use crate::serve::{ConnectorArg, millis};

/// Flags of `demo`.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// The user message sent.
    #[arg(
        long,
        default_value = "Explain in one paragraph why splitting prefill and decode across engines helps large language model serving."
    )]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 24)]
    max_tokens: u32,
    /// Simulated prefill cost per prompt token, in milliseconds.
    #[arg(long, default_value_t = 2.0)]
    prefill_ms_per_token: f64,
    /// Simulated time between generated tokens, in milliseconds.
    #[arg(long, default_value_t = 25.0)]
    inter_token_ms: f64,
    /// The KV-transfer protocol the simulated engines and the proxy speak.
    #[arg(long, value_enum, default_value_t = ConnectorArg::Nixl)]
    connector: ConnectorArg,
    /// E/P/D: send an image with the message, encoded first by a simulated encoder-only
    /// engine whose output the prefill reads from a shared directory (vLLM's encoder
    /// protocol; `--connector nixl` or `mooncake`).
    #[arg(long)]
    encode: bool,
}

/// The simulated engines' common settings: the flags' delays, refused when negative,
/// not a number or too large (a panic or a silent 0 otherwise).
fn sim_config(args: &DemoArgs) -> Result<SimConfig, BoxError> {
    Ok(SimConfig {
        prefill_delay_per_token: millis(args.prefill_ms_per_token, "prefill-ms-per-token")?,
        inter_token_delay: millis(args.inter_token_ms, "inter-token-ms")?,
        ..SimConfig::default()
    })
}

pub(crate) async fn run(args: DemoArgs) -> Result<(), BoxError> {
    let sim = sim_config(&args)?;
    let (p_mode, d_mode) = match args.connector {
        ConnectorArg::Nixl => (KvMode::Nixl, KvMode::Nixl),
        ConnectorArg::Sglang => (
            KvMode::Sglang(SimRole::Prefill),
            KvMode::Sglang(SimRole::Decode),
        ),
        ConnectorArg::Mooncake => (
            KvMode::Mooncake(SimRole::Prefill),
            KvMode::Mooncake(SimRole::Decode),
        ),
        ConnectorArg::Lmcache => (
            KvMode::Lmcache(SimRole::Prefill),
            KvMode::Lmcache(SimRole::Decode),
        ),
    };
    // LMCache: the proxy's notification socket, which the prefill engine reports to, and
    // a decode engine of TP 2 receiving the KV on two init and two alloc ports.
    let notifications = match args.connector {
        ConnectorArg::Lmcache => {
            Some(Notifications::bind("127.0.0.1:0", NotifyConfig::default()).await?)
        }
        _ => None,
    };
    let lmcache_proxy = notifications
        .as_ref()
        .and_then(Notifications::local_addr)
        .map(|a| a.to_string());
    let plan = nixl_plan()?;
    // E/P/D: an encoder-only engine and the directory it shares with the prefill.
    let ec_store = args
        .encode
        .then(|| std::env::temp_dir().join(format!("disagg-demo-ec-{}", std::process::id())));
    let encoder = match &ec_store {
        None => None,
        Some(store) => Some(
            SimEngine::start(SimConfig {
                ec: Some(disagg_sim::EcConfig {
                    role: disagg_sim::EcRole::Producer,
                    store: store.clone(),
                }),
                ..sim.clone()
            })
            .await?,
        ),
    };
    if let Some(e) = &encoder {
        println!("encoder engine  {}  (encoder-only)", e.url());
    }
    let prefill = start_planned(
        SimConfig {
            kv_mode: p_mode,
            lmcache_proxy,
            ec: ec_store.clone().map(|store| disagg_sim::EcConfig {
                role: disagg_sim::EcRole::Consumer,
                store,
            }),
            ..sim.clone()
        },
        &plan.engines[0],
    )
    .await?;
    let decode = start_planned(
        SimConfig {
            kv_mode: d_mode,
            lmcache_receiver: disagg_sim::LmcacheReceiver::ephemeral(2),
            ..sim
        },
        &plan.engines[1],
    )
    .await?;
    match prefill.bootstrap_addr() {
        Some(b) => println!(
            "prefill engine  {}  (bootstrap server {b}, KV side channel {})",
            prefill.url(),
            prefill.side_channel_addr()
        ),
        None => println!(
            "prefill engine  {}  (KV side channel {})",
            prefill.url(),
            prefill.side_channel_addr()
        ),
    }
    let mut decode_facts = Facts::default();
    if let Some(n) = &notifications {
        let (init, alloc) = (decode.lmcache_init_ports(), decode.lmcache_alloc_ports());
        println!(
            "decode engine   {}  (LMCache receiver: init ports {init:?}, alloc ports {alloc:?}; proxy notifications on {})",
            decode.url(),
            n.local_addr()
                .map_or_else(|| "-".to_owned(), |a| a.to_string()),
        );
        let receiver = LmcacheReceiver::new("127.0.0.1", init, alloc)?;
        decode_facts.insert(Facts::KV_RECEIVER, receiver.to_string())?;
    } else {
        println!("decode engine   {}", decode.url());
    }

    let mut prefill_facts = Facts::default();
    if let Some(b) = prefill.bootstrap_addr() {
        prefill_facts.insert(Facts::BOOTSTRAP_PORT, b.port().to_string())?;
    }
    let connector = args.connector.connector(
        notifications.clone(),
        VllmLimits::default(),
        // The demo's decode declares no version: `auto` leaves reuse off.
        (crate::serve::ReuseArg::Auto, Arc::default()),
        None,
    )?;
    // Every prefill/decode pair is checked before the first request.
    let mut endpoints = vec![
        Endpoint::new(&prefill.url(), Role::Prefill)?.with_facts(prefill_facts),
        Endpoint::new(&decode.url(), Role::Decode)?.with_facts(decode_facts),
    ];
    if let Some(e) = &encoder {
        endpoints.push(Endpoint::new(&e.url(), Role::Encode)?);
    }
    let source = ValidatedSource::new(StaticSource::new(endpoints), Arc::clone(&connector))?;
    let mut builder = Orchestrator::builder(source, HttpTransport::default(), connector);
    if encoder.is_some() {
        builder = builder.encoder(Arc::new(disagg_core::encode::EncodeStage::new(
            disagg_connectors::vllm::VllmEncoder::new(),
            disagg_core::encode::EncodeConfig::default(),
        )));
    }
    let orchestrator = builder.build();
    println!("connector       {}", args.connector.name());
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let proxy = format!("http://{}", listener.local_addr()?);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(disagg_http::server::Builder::new().serve(
        listener,
        PdService::new(orchestrator),
        async {
            let _ = stop_rx.await;
        },
    ));
    println!("disagg proxy    {proxy}\n");

    let body = body_json(&args, true);
    println!("> {}\n", args.prompt);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let started = Instant::now();
    let req = http::Request::post(format!("{proxy}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let resp = client.request(req).await?;
    let status = resp.status();
    let timing = resp
        .headers()
        .get("server-timing")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let handoff = resp
        .headers()
        .get("x-disagg-handoff")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    if !status.is_success() {
        let text = resp.into_body().collect().await?.to_bytes();
        return Err(format!(
            "proxy answered {status}: {}",
            String::from_utf8_lossy(&text)
        )
        .into());
    }

    let mut body = resp.into_body();
    let mut pending = Vec::new();
    let mut text = String::new();
    let mut first_token = None;
    let mut done = false;
    let mut stdout = std::io::stdout();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        pending.extend_from_slice(&data);
        while let Some(end) = find(&pending, b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let line = String::from_utf8_lossy(&event);
            let Some(payload) = line.trim().strip_prefix("data: ") else {
                continue;
            };
            if payload == "[DONE]" {
                done = true;
                continue;
            }
            let chunk: serde_json::Value = serde_json::from_str(payload)?;
            if let Some(err) = chunk.get("error") {
                return Err(format!("stream failed: {err}").into());
            }
            let delta = chunk["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or("");
            if !delta.is_empty() {
                first_token.get_or_insert_with(|| started.elapsed());
                text.push_str(delta);
                print!("{delta}");
                stdout.flush()?;
            }
        }
    }
    let total = started.elapsed();
    println!("\n");
    if !done {
        return Err("the stream ended without [DONE]".into());
    }

    let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1e3);
    let phase = |name: &str| {
        timing
            .split(", ")
            .find_map(|p| p.strip_prefix(name)?.strip_prefix(";dur="))
            .and_then(|v| v.parse::<f64>().ok())
            .map_or_else(|| "-".to_owned(), |v| format!("{v:.1} ms"))
    };
    println!(
        "timing: prefill {} | handoff {} | decode head {} | first token {} | total {}",
        phase("prefill"),
        phase("handoff"),
        phase("decode"),
        first_token.map_or_else(|| "-".to_owned(), ms),
        ms(total),
    );

    // Proof that the KV really crossed from the prefill, from the engines' own counters.
    let p = prefill.stats();
    let d = decode.stats();
    println!(
        "kv handoff ({handoff}): the prefill engine handled {} prefill(s); the decode engine took remote KV {} time(s) and computed {} prompt(s) locally; KV still held by the prefill: {} block(s), {} transfer(s)",
        p.prefill_requests,
        d.remote_decodes,
        d.local_prefills,
        p.blocks_held,
        p.kv_transfers_pending
    );
    if handoff != "kv" || p.prefill_requests != 1 || d.remote_decodes != 1 || d.local_prefills != 0
    {
        return Err("the KV was not handed over from the prefill engine".into());
    }
    if let Some(e) = &encoder {
        let encoded = e.stats().ec_items_encoded;
        println!(
            "encoder stage: the encoder engine encoded {encoded} image(s); the prefill engine read {} from the shared store",
            p.ec_items_loaded
        );
        if encoded != 1 || p.ec_items_loaded != 1 {
            return Err("the image did not go through the encoder stage".into());
        }
    }

    // The same request to a plain engine (no disaggregation; the decode engine of a
    // concurrent protocol refuses requests without handoff fields) gives the same text.
    let plain = SimEngine::start(SimConfig {
        kv_mode: KvMode::Nixl,
        ..decode.config().clone()
    })
    .await?;
    let direct = body_json(&args, false);
    let req = http::Request::post(format!("{}/v1/chat/completions", plain.url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(direct.to_string())))?;
    let resp = client.request(req).await?;
    let bytes = resp.into_body().collect().await?.to_bytes();
    let answer: serde_json::Value = serde_json::from_slice(&bytes)?;
    let direct_text = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    if direct_text != text {
        return Err(
            format!("disaggregated text differs from a direct run: {direct_text:?}").into(),
        );
    }
    println!("output identical to a direct (non-disaggregated) run: yes");
    plain.shutdown().await;
    if let Some(store) = ec_store {
        let _ = std::fs::remove_dir_all(store);
    }

    let _ = stop_tx.send(());
    server.await??;
    Ok(())
}

/// The side-channel ports and engine ids of the demo's engines, from the NIXL planner as
/// a launcher would compute them for one node: prefill then decode, default bases.
fn nixl_plan() -> Result<disagg_nixl::NodePlan, BoxError> {
    use disagg_nixl::{Deployment, Host, NixlRole, Plan, PortScheme};
    let node = Host::new("127.0.0.1")
        .with_deployment(Deployment::new("prefill", NixlRole::Prefill))
        .with_deployment(Deployment::new("decode", NixlRole::Decode));
    Ok(Plan::new(PortScheme::PerEngine).with_host(node).plan()?)
}

/// Starts a simulated engine whose side channel listens on its planned port, or on any
/// free port if that one is taken on this machine (the demo must run anywhere).
async fn start_planned(
    config: SimConfig,
    engine: &disagg_nixl::EnginePlan,
) -> Result<SimEngine, BoxError> {
    let http = TcpListener::bind("127.0.0.1:0").await?;
    let side_channel =
        match TcpListener::bind((engine.side_channel_host.as_str(), engine.port)).await {
            Ok(listener) => listener,
            Err(_) => TcpListener::bind("127.0.0.1:0").await?,
        };
    let config = SimConfig {
        engine_id: Some(engine.engine_id.clone()),
        ..config
    };
    Ok(SimEngine::start_on(config, http, side_channel).await?)
}

fn body_json(args: &DemoArgs, stream: bool) -> serde_json::Value {
    let content = if args.encode {
        serde_json::json!([
            {"type": "text", "text": args.prompt},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ])
    } else {
        serde_json::json!(args.prompt)
    };
    serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": args.max_tokens,
        "stream": stream,
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        demo: DemoArgs,
    }

    fn sim(args: &[&str]) -> Result<SimConfig, BoxError> {
        let cli = Cli::try_parse_from(std::iter::once("demo").chain(args.iter().copied()))?;
        sim_config(&cli.demo)
    }

    #[test]
    fn delays_that_are_no_duration_are_refused_not_a_panic() {
        for (flag, value) in [
            ("--inter-token-ms", "inf"),
            ("--inter-token-ms", "NaN"),
            ("--inter-token-ms", "-1"),
            ("--prefill-ms-per-token", "1e300"),
            ("--prefill-ms-per-token", "-0.5"),
        ] {
            let arg = format!("{flag}={value}");
            let err = sim(&[&arg]).expect_err(&arg).to_string();
            assert!(err.starts_with(flag), "{arg}: {err}");
        }
        let c = sim(&["--inter-token-ms", "25", "--prefill-ms-per-token", "0"]).expect("valid");
        assert_eq!(c.inter_token_delay, Duration::from_millis(25));
        assert_eq!(c.prefill_delay_per_token, Duration::ZERO);
    }
}
