//! A user-written `Router`: each engine is tagged with the model it serves (in its
//! `Endpoint::ext`), and a request goes to the least busy prefill and decode engines
//! of its `model`. Nothing in disagg changes: the router is handed to the builder.
//!
//! Run (engines first, each `ROLE,URL,MODEL`; simulated ones take `--model NAME`):
//!
//! ```text
//! cargo run --example custom_router -- \
//!     prefill,http://127.0.0.1:8100,model-a decode,http://127.0.0.1:8200,model-a \
//!     prefill,http://127.0.0.1:8101,model-b decode,http://127.0.0.1:8201,model-b
//! ```
//!
//! The proxy listens on `DISAGG_LISTEN` (default `127.0.0.1:8000`).

use std::future::Future;
use std::sync::Arc;

use disagg::connectors::vllm::VllmNixl;
use disagg::core::error::RouteError;
use disagg::core::router::RequestView;
use disagg::core::{
    Endpoint, Orchestrator, Role, Router, endpoint::EndpointSet, router::Route,
    source::StaticSource,
};
use disagg::http::{HttpTransport, PdService, server};
use tokio::net::TcpListener;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The model an engine serves, kept in its `Endpoint::ext`.
#[derive(Debug, Clone)]
pub struct Model(pub String);

/// Engines of the request's model (any engine when the request names none or an
/// engine is untagged), the one with the fewest requests in flight for each leg.
#[derive(Debug, Default)]
pub struct ByModel;

impl Router for ByModel {
    fn select(&self, req: &RequestView<'_>, set: &EndpointSet) -> Result<Route, RouteError> {
        let serves = |ep: &&Arc<Endpoint>| match (req.model, ep.ext().get::<Model>()) {
            (Some(want), Some(Model(model))) => model == want,
            _ => true,
        };
        let least_busy = |eps: &[Arc<Endpoint>]| {
            eps.iter()
                .filter(serves)
                .min_by_key(|ep| ep.in_flight())
                .cloned()
        };
        let decode = least_busy(set.by_role(Role::Decode)).ok_or(RouteError::NoDecode)?;
        // No prefill engine for the model: the orchestrator's `no_prefill` policy decides.
        Ok(Route::new(least_busy(set.by_role(Role::Prefill)), decode))
    }
}

/// An endpoint from `ROLE,URL,MODEL`.
pub fn endpoint(spec: &str) -> Result<Endpoint, BoxError> {
    let mut parts = spec.splitn(3, ',');
    let (Some(role), Some(url), Some(model)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(format!("expected ROLE,URL,MODEL, got {spec:?}").into());
    };
    let role = match role {
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        other => return Err(format!("role must be prefill or decode, got {other:?}").into()),
    };
    let mut ext = http::Extensions::new();
    ext.insert(Model(model.to_owned()));
    Ok(Endpoint::with_extensions(url, role, ext)?)
}

/// Serve a proxy over `engines` (each `ROLE,URL,MODEL`) on `listener` until `shutdown`.
pub async fn run(
    listener: TcpListener,
    engines: &[String],
    shutdown: impl Future<Output = ()>,
) -> Result<(), BoxError> {
    let endpoints = engines
        .iter()
        .map(|s| endpoint(s))
        .collect::<Result<Vec<_>, _>>()?;
    let orchestrator = Orchestrator::builder(
        StaticSource::new(endpoints),
        HttpTransport::default(),
        VllmNixl::new(),
    )
    .router(ByModel)
    .build();
    server::Builder::new()
        .serve(listener, PdService::new(orchestrator), shutdown)
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let engines: Vec<String> = std::env::args().skip(1).collect();
    let listen = std::env::var("DISAGG_LISTEN").unwrap_or_else(|_| "127.0.0.1:8000".into());
    let listener = TcpListener::bind(&listen).await?;
    println!(
        "proxy routing by model on http://{}",
        listener.local_addr()?
    );
    run(listener, &engines, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}
