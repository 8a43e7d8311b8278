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
use disagg_pairing::{EcProfile, EcRole, KvProfile, KvRole};
use disagg_resilience::pairing::ValidatedSource;
use disagg_sim::{KvMode, SimConfig, SimEngine, SimRole};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
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
    /// protocol, the stage `serve --encode` runs). With `--connector nixl` or
    /// `mooncake`; refused with `sglang`, whose prefill calls its encoders itself (so
    /// `serve` runs no encoder stage), and with `lmcache`, whose legs carry the prompt's
    /// token ids, not its media.
    #[arg(long)]
    encode: bool,
}

/// The flag combinations the demo cannot show, refused before any engine starts.
fn check(args: &DemoArgs) -> Result<(), BoxError> {
    if !args.encode {
        return Ok(());
    }
    match args.connector {
        ConnectorArg::Nixl | ConnectorArg::Mooncake => Ok(()),
        ConnectorArg::Sglang => Err(
            "--encode needs --connector nixl or mooncake: with sglang the prefill calls its encoders itself (--language-only --encoder-urls), so the proxy, as `serve` does, runs no encoder stage to show"
                .into(),
        ),
        ConnectorArg::Lmcache => Err(
            "--encode needs --connector nixl or mooncake: lmcache's legs carry the prompt's token ids (/tokenize, then /v1/completions), not its media, so the prefill never reads the encoder's output"
                .into(),
        ),
    }
}

/// The TP size of the LMCache demo's engines: the decode's receiver ports per kind, and
/// the prefill's ranks pushing to them.
const LMCACHE_TP: usize = 2;

/// The KV connector the demo's engines run, as they name it (vLLM's `kv_connector`, or
/// `sglang`), for their declared profiles.
fn engine_connector(connector: ConnectorArg) -> &'static str {
    match connector {
        ConnectorArg::Nixl => "NixlConnector",
        ConnectorArg::Sglang => "sglang",
        ConnectorArg::Mooncake => "MooncakeConnector",
        ConnectorArg::Lmcache => "LMCacheConnectorV1",
    }
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
    check(&args)?;
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
    // LMCache: the prefill runs as many TP ranks as the decode has receiver ports, each
    // pushing to the port of its rank (what the pair check below holds it to).
    let lmcache = args.connector == ConnectorArg::Lmcache;
    let prefill = start_planned(
        SimConfig {
            kv_mode: p_mode,
            lmcache_proxy,
            lmcache_prefill_tp_size: lmcache.then_some(LMCACHE_TP),
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
            lmcache_receiver: disagg_sim::LmcacheReceiver::ephemeral(LMCACHE_TP),
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
    let mut receiver = None;
    if let Some(n) = &notifications {
        let (init, alloc) = (decode.lmcache_init_ports(), decode.lmcache_alloc_ports());
        println!(
            "decode engine   {}  (LMCache receiver: init ports {init:?}, alloc ports {alloc:?}; proxy notifications on {})",
            decode.url(),
            n.local_addr()
                .map_or_else(|| "-".to_owned(), |a| a.to_string()),
        );
        receiver = Some(LmcacheReceiver::new("127.0.0.1", init, alloc)?);
    } else {
        println!("decode engine   {}", decode.url());
    }
    let connector = args.connector.connector(
        notifications.clone(),
        VllmLimits::default(),
        // The demo's decode declares no version: `auto` leaves reuse off.
        (crate::serve::ReuseArg::Auto, Arc::default()),
        None,
        disagg_connectors::lmcache::CONTEXT_PROBE_TIMEOUT,
    )?;
    let endpoints = declared_endpoints(
        args.connector,
        (
            &prefill.url(),
            prefill.bootstrap_addr().map(|b| b.port()),
            if lmcache {
                u32::try_from(LMCACHE_TP)?
            } else {
                1
            },
        ),
        (&decode.url(), receiver.as_ref()),
        encoder.as_ref().map(SimEngine::url).as_deref(),
    )?;
    // Every prefill/decode pair, and the encoder with its consumer, is checked before
    // the first request on what they declare: a demo whose engines could not hand over
    // stops here, as `serve` does.
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
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
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
    let direct_text = direct_text(&client, &plain.url(), &body_json(&args, false)).await?;
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

/// The text the plain engine at `url` answers the chat request `body` with.
///
/// # Errors
///
/// The engine's status and error body when it answers an error; an answer that is not
/// a chat completion.
async fn direct_text(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: &str,
    body: &serde_json::Value,
) -> Result<String, BoxError> {
    let req = http::Request::post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let resp = client.request(req).await?;
    let status = resp.status();
    // The demo's own engine, read within a ceiling all the same.
    let bytes = Limited::new(resp.into_body(), DIRECT_ANSWER_MAX)
        .collect()
        .await
        .map_err(|e| format!("the direct run's answer (status {status}): {e}"))?
        .to_bytes();
    if !status.is_success() {
        return Err(format!(
            "the direct run's engine answered {status}: {}",
            String::from_utf8_lossy(&bytes)
        )
        .into());
    }
    let answer: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| format!("the direct run's answer is not JSON: {e}"))?;
    match answer["choices"][0]["message"]["content"].as_str() {
        Some(text) => Ok(text.to_owned()),
        None => Err(format!("the direct run's answer has no message content: {answer}").into()),
    }
}

/// The largest answer of the direct run read (a chat completion of a few dozen tokens).
const DIRECT_ANSWER_MAX: usize = 1 << 20;

/// The demo's engines as endpoints, each declaring what `serve --kv-profile` and
/// `--ec-profile` would: its KV connector (as the engine names it), its role and TP
/// size, and (E/P/D) its EC connector and role. The prefill's bootstrap port goes into
/// its facts; an LMCache decode's receiver is installed with
/// [`LmcacheReceiver::insert_into`], which declares its TP size (one port of each kind
/// per rank): the pair check then holds it to the prefill's `prefill_tp`.
fn declared_endpoints(
    connector: ConnectorArg,
    (prefill, bootstrap_port, prefill_tp): (&str, Option<u16>, u32),
    (decode, receiver): (&str, Option<&LmcacheReceiver>),
    encoder: Option<&str>,
) -> Result<Vec<Endpoint>, BoxError> {
    let kv_profile = |role, tp_size| KvProfile {
        connector: Some(engine_connector(connector).to_owned()),
        role: Some(role),
        tp_size,
    };
    let ec_profile = |role| EcProfile {
        connector: Some("ECExampleConnector".to_owned()),
        role: Some(role),
    };
    let mut prefill_ext = http::Extensions::new();
    prefill_ext.insert(kv_profile(KvRole::Producer, Some(prefill_tp)));
    if encoder.is_some() {
        prefill_ext.insert(ec_profile(EcRole::Consumer));
    }
    let mut prefill_facts = Facts::default();
    if let Some(port) = bootstrap_port {
        prefill_facts.insert(Facts::BOOTSTRAP_PORT, port.to_string())?;
    }
    let mut decode_ext = http::Extensions::new();
    let mut decode_facts = Facts::default();
    match receiver {
        Some(r) => {
            decode_ext.insert(kv_profile(KvRole::Consumer, None));
            r.insert_into(&mut decode_facts, &mut decode_ext)?;
        }
        None => {
            decode_ext.insert(kv_profile(KvRole::Consumer, Some(1)));
        }
    }
    let mut endpoints = vec![
        Endpoint::with_extensions(prefill, Role::Prefill, prefill_ext)?.with_facts(prefill_facts),
        Endpoint::with_extensions(decode, Role::Decode, decode_ext)?.with_facts(decode_facts),
    ];
    if let Some(url) = encoder {
        let mut ext = http::Extensions::new();
        ext.insert(ec_profile(EcRole::Producer));
        endpoints.push(Endpoint::with_extensions(url, Role::Encode, ext)?);
    }
    Ok(endpoints)
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

    #[tokio::test]
    async fn the_demo_engines_declare_what_the_pair_check_reads() {
        use disagg_core::endpoint::EndpointSet;
        use disagg_resilience::pairing::check_pairs;
        let set = |endpoints: Vec<Endpoint>| EndpointSet::new(endpoints.into_iter().map(Arc::new));
        let receiver = |n: u16| {
            LmcacheReceiver::new(
                "127.0.0.1",
                (0..n).map(|i| 7300 + i).collect(),
                (0..n).map(|i| 7400 + i).collect(),
            )
            .unwrap()
        };
        let notifications = Notifications::bind("127.0.0.1:0", NotifyConfig::default())
            .await
            .unwrap();
        let connector = |c: ConnectorArg| {
            c.connector(
                Some(notifications.clone()),
                VllmLimits::default(),
                (crate::serve::ReuseArg::Off, Arc::default()),
                None,
                disagg_connectors::lmcache::CONTEXT_PROBE_TIMEOUT,
            )
            .unwrap()
        };
        let (p, d, e) = (
            "http://127.0.0.1:1",
            "http://127.0.0.1:2",
            "http://127.0.0.1:3",
        );
        for c in [
            ConnectorArg::Nixl,
            ConnectorArg::Sglang,
            ConnectorArg::Mooncake,
        ] {
            let endpoints =
                set(declared_endpoints(c, (p, Some(8998), 1), (d, None), Some(e)).unwrap());
            check_pairs(&endpoints, &*connector(c)).expect("the demo's pair");
            // What is declared is checked: the same engines under another protocol are
            // refused.
            let other = match c {
                ConnectorArg::Nixl => ConnectorArg::Mooncake,
                _ => ConnectorArg::Nixl,
            };
            let err = check_pairs(&endpoints, &*connector(other)).unwrap_err();
            assert!(err.to_string().contains(engine_connector(c)), "{err}");
        }
        // LMCache: the decode's receiver declares its TP size, which must be the
        // prefill's.
        let lmcache = connector(ConnectorArg::Lmcache);
        let two = receiver(2);
        let endpoints =
            declared_endpoints(ConnectorArg::Lmcache, (p, None, 2), (d, Some(&two)), None).unwrap();
        let tp = endpoints[1]
            .ext()
            .get::<KvProfile>()
            .and_then(|k| k.tp_size);
        assert_eq!(tp, Some(2));
        assert!(endpoints[1].facts().get(Facts::KV_RECEIVER).is_some());
        check_pairs(&set(endpoints), &*lmcache).expect("TP 2 to 2 ports");
        let three = receiver(3);
        let endpoints =
            declared_endpoints(ConnectorArg::Lmcache, (p, None, 2), (d, Some(&three)), None)
                .unwrap();
        let err = check_pairs(&set(endpoints), &*lmcache).unwrap_err();
        assert!(
            err.to_string().contains("tensor-parallel size 2 to 3"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn encode_with_sglang_is_refused_before_any_engine_starts() {
        let cli = Cli::try_parse_from(["demo", "--encode", "--connector", "sglang"]).unwrap();
        let err = run(cli.demo).await.expect_err("refused").to_string();
        assert!(
            err.contains("--encode") && err.contains("sglang") && err.contains("encoders itself"),
            "{err}"
        );
        // LMCache's legs carry token ids: its prefill never reads an encoder's output.
        let cli = Cli::try_parse_from(["demo", "--encode", "--connector", "lmcache"]).unwrap();
        let err = run(cli.demo).await.expect_err("refused").to_string();
        assert!(
            err.contains("lmcache") && err.contains("token ids"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn an_engine_error_in_the_direct_run_is_reported_with_its_body() {
        let engine = SimEngine::start(SimConfig {
            faults: disagg_sim::Faults {
                status: Some(503),
                ..disagg_sim::Faults::default()
            },
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        let cli = Cli::try_parse_from(["demo"]).unwrap();
        let err = direct_text(&client, &engine.url(), &body_json(&cli.demo, false))
            .await
            .expect_err("an engine error is no text")
            .to_string();
        // The status, and the engine's own error body.
        assert!(
            err.contains("503") && err.contains("Simulated fault: the engine answers 503"),
            "{err}"
        );
        engine.shutdown().await;
    }
}
