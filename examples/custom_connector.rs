//! A user-written `KvConnector`: vLLM's NIXL pull protocol, except that the decode is
//! told to reach the prefill's KV side channel at the host of the prefill's URL rather
//! than at the `remote_host` the prefill engine advertised (engines left on vLLM's
//! default `VLLM_NIXL_SIDE_CHANNEL_HOST=localhost` advertise a name that is wrong from any
//! other host). Nothing in disagg changes: the connector is handed to the builder.
//!
//! Run (engines first, real vLLM engines with the NIXL connector or simulated ones):
//!
//! ```text
//! cargo run -p disagg-proxy -- sim --listen 127.0.0.1:8100 --side-channel 127.0.0.1:5600 &
//! cargo run -p disagg-proxy -- sim --listen 127.0.0.1:8200 --side-channel 127.0.0.1:5601 &
//! cargo run --example custom_connector -- http://127.0.0.1:8100 http://127.0.0.1:8200 127.0.0.1:8000
//! ```
//!
//! The arguments can also come from `DISAGG_PREFILL`, `DISAGG_DECODE` and
//! `DISAGG_LISTEN`.

use std::future::Future;

use async_trait::async_trait;
use disagg::connectors::vllm::rewrite::PrefillRewriter;
use disagg::core::connector::{Dispatch, Handoff, HandoffFound, KvConnector, Leg, PrefillAnswer};
use disagg::core::error::ConnectorError;
use disagg::core::{Endpoint, Orchestrator, PdRequest, Role, router::Route, source::StaticSource};
use disagg::http::{HttpTransport, PdService, server};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// NIXL pull, with the decode's `remote_host` pinned to the prefill URL's host.
#[derive(Debug, Default)]
pub struct PinnedHostNixl {
    rewriter: PrefillRewriter,
}

#[async_trait]
impl KvConnector for PinnedHostNixl {
    fn name(&self) -> &'static str {
        "nixl-pinned-host"
    }

    fn prepare(&self, route: &Route, req: &PdRequest) -> Result<Handoff, ConnectorError> {
        let prefill = route.prefill.clone().ok_or(ConnectorError::NeedsPrefill {
            connector: self.name(),
        })?;
        // One token, not streamed, length-capped: then the engine keeps the KV for us.
        let mut body = self.rewriter.rewrite(req.api(), req.body());
        body.set(
            "kv_transfer_params",
            &json!({"do_remote_decode": true, "do_remote_prefill": false}),
        );
        Ok(Handoff::new(
            Dispatch::AfterPrefill,
            Leg::new(prefill, body),
            Leg::new(route.decode.clone(), req.body().clone()),
        ))
    }

    async fn complete(
        &self,
        handoff: &mut Handoff,
        answer: &PrefillAnswer,
    ) -> Result<HandoffFound, ConnectorError> {
        let prefill = &handoff.prefill.endpoint;
        let invalid = |field| ConnectorError::InvalidHandoff {
            endpoint: prefill.id().clone(),
            field,
        };
        let raw = disagg::core::json::top_level_field(&answer.body, "kv_transfer_params")
            .map_err(|_| invalid("kv_transfer_params"))?;
        let params: Option<Map<String, Value>> = match raw {
            None => None,
            Some(raw) => serde_json::from_slice(&raw).map_err(|_| invalid("kv_transfer_params"))?,
        };
        let Some(mut params) = params.filter(|p| !p.is_empty()) else {
            // The prefill kept no KV; the orchestrator's missing-KV policy decides.
            return Ok(HandoffFound::Missing);
        };
        params.insert("remote_host".into(), Value::from(prefill.host()));
        handoff.decode.body.set("kv_transfer_params", &params);
        Ok(HandoffFound::Handed)
    }
}

/// Serve a proxy with the connector on `listener` until `shutdown` resolves.
pub async fn run(
    listener: TcpListener,
    prefill: &str,
    decode: &str,
    shutdown: impl Future<Output = ()>,
) -> Result<(), BoxError> {
    let source = StaticSource::new([
        Endpoint::new(prefill, Role::Prefill)?,
        Endpoint::new(decode, Role::Decode)?,
    ]);
    let orchestrator =
        Orchestrator::builder(source, HttpTransport::default(), PinnedHostNixl::default()).build();
    server::Builder::new()
        .serve(listener, PdService::new(orchestrator), shutdown)
        .await?;
    Ok(())
}

fn arg(args: &mut impl Iterator<Item = String>, env: &str, default: &str) -> String {
    args.next()
        .or_else(|| std::env::var(env).ok())
        .unwrap_or_else(|| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let prefill = arg(&mut args, "DISAGG_PREFILL", "http://127.0.0.1:8100");
    let decode = arg(&mut args, "DISAGG_DECODE", "http://127.0.0.1:8200");
    let listen = arg(&mut args, "DISAGG_LISTEN", "127.0.0.1:8000");
    let listener = TcpListener::bind(&listen).await?;
    println!(
        "proxy with a custom connector on http://{}",
        listener.local_addr()?
    );
    run(listener, &prefill, &decode, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}
