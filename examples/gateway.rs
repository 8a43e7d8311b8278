//! Gateway mode: a plain hyper server whose own service answers `/health` and
//! `/version`, with `PdLayer` in front sending every chat and completion request across a
//! remote prefill and a remote decode engine.
//!
//! Run (engines first: real vLLM engines with the NIXL connector, or two simulated ones):
//!
//! ```text
//! cargo run -p disagg-proxy -- sim --listen 127.0.0.1:8100 --side-channel 127.0.0.1:5600 &
//! cargo run -p disagg-proxy -- sim --listen 127.0.0.1:8200 --side-channel 127.0.0.1:5601 &
//! cargo run --example gateway -- http://127.0.0.1:8100 http://127.0.0.1:8200 127.0.0.1:8000
//! ```
//!
//! The arguments can also come from `DISAGG_PREFILL`, `DISAGG_DECODE` and
//! `DISAGG_LISTEN`. Then `curl localhost:8000/health` is the app's answer and
//! `curl localhost:8000/v1/completions -d '{"model":"sim-model","prompt":"hi"}'` is
//! served disaggregated.

use std::convert::Infallible;
use std::future::Future;

use bytes::Bytes;
use disagg::connectors::vllm::VllmNixl;
use disagg::core::{Endpoint, Orchestrator, Role, source::StaticSource};
use disagg::http::{HttpTransport, PdLayer};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::ServiceBuilder;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The app's own routes: whatever is not a chat or completion request lands here.
async fn app(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let (status, body) = match req.uri().path() {
        "/health" => (StatusCode::OK, "ok"),
        "/version" => (StatusCode::OK, env!("CARGO_PKG_VERSION")),
        _ => (StatusCode::NOT_FOUND, "not found"),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    Ok(resp)
}

/// Serve the app behind the layer on `listener` until `shutdown` resolves.
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
        Orchestrator::builder(source, HttpTransport::default(), VllmNixl::new()).build();
    let service = ServiceBuilder::new()
        .layer(PdLayer::gateway(orchestrator))
        .service_fn(app);
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => accepted?,
            () = &mut shutdown => return Ok(()),
        };
        stream.set_nodelay(true)?;
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            if let Err(e) = conn.await {
                eprintln!("connection ended with an error: {e}");
            }
        });
    }
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
    println!("gateway on http://{}", listener.local_addr()?);
    run(listener, &prefill, &decode, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}
