//! TLS and keys at the edge over real loopback sockets, with certificates made here
//! (rcgen): `HttpTransport` to simulated engines serving HTTPS (verified against the
//! right CA or refused, client certificates, pooled connections, engine keys), and the
//! server's HTTPS with a certificate rotated under open connections.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use disagg_core::error::TransportError;
use disagg_core::transport::Transport;
use disagg_http::auth::EngineKeys;
use disagg_http::server;
use disagg_http::tls::{self, ClientTls, PemFiles, ServerTls};
use disagg_http::{HttpTransport, HttpTransportConfig};
use disagg_sim::{SimConfig, SimEngine, SimTls};
use http_body_util::{BodyExt, Full};
use rustls::pki_types::{CertificateDer, ServerName};

// The certificates and files the proxy's own TLS tests make: one copy for both crates.
#[path = "../../disagg-proxy/tests/common/certs.rs"]
#[allow(dead_code, unreachable_pub)] // shared: this file uses part of it, privately
mod certs;
use certs::{Ca, Pair, TempDir};

/// The roots trusting `ca`.
fn roots(ca: &Ca) -> rustls::RootCertStore {
    tls::roots_from_pem(ca.pem.as_bytes(), "test CA").unwrap()
}

async fn https_engine(ca: &Ca, client_ca: Option<&Ca>, api_key: Option<&str>) -> SimEngine {
    let pair = ca.server("engine");
    SimEngine::start(SimConfig {
        tls: Some(SimTls {
            cert_pem: pair.cert,
            key_pem: pair.key,
            client_ca_pem: client_ca.map(|c| c.pem.clone()),
        }),
        api_key: api_key.map(str::to_owned),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

fn completion(engine: &SimEngine) -> http::Request<Bytes> {
    let body = r#"{"model":"sim-model","prompt":"over tls","max_tokens":3}"#;
    let mut req = http::Request::new(Bytes::from_static(body.as_bytes()));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = format!("{}/v1/completions", engine.url()).parse().unwrap();
    req.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    req
}

fn transport(tls: ClientTls, keys: EngineKeys) -> HttpTransport {
    let mut config = HttpTransportConfig::default();
    config.tls = Some(tls);
    config.engine_keys = keys;
    HttpTransport::new(config)
}

/// The status of `req` sent through `t`, its body read to the end.
async fn status(t: &HttpTransport, req: http::Request<Bytes>) -> u16 {
    let resp = t.send(req).await.expect("an answer");
    let status = resp.status().as_u16();
    resp.into_body().collect().await.unwrap();
    status
}

#[tokio::test]
async fn https_engines_are_verified_and_their_connections_pooled() {
    let ca = Ca::new("engines CA");
    let engine = https_engine(&ca, None, None).await;
    assert!(engine.url().starts_with("https://"));
    let t = transport(
        ClientTls::new(roots(&ca), tls::default_provider()).unwrap(),
        EngineKeys::default(),
    );
    for _ in 0..3 {
        assert_eq!(status(&t, completion(&engine)).await, 200);
    }
    // One TLS connection carried the three requests, and is kept for the next.
    assert_eq!(engine.stats().http_connections, 1);
    assert_eq!(
        t.idle_connections(&engine.addr().to_string().parse().unwrap()),
        1
    );

    // Another CA's transport refuses the engine's certificate: a connect error naming
    // the handshake and why.
    let other = Ca::new("another CA");
    let t = transport(
        ClientTls::new(roots(&other), tls::default_provider()).unwrap(),
        EngineKeys::default(),
    );
    let err = t.send(completion(&engine)).await.unwrap_err();
    assert!(matches!(err, TransportError::Connect(_)), "{err:?}");
    let msg = disagg_core::error::error_chain(&err);
    assert!(
        msg.contains("TLS handshake with 127.0.0.1") && msg.contains("UnknownIssuer"),
        "{msg}"
    );
    assert_eq!(engine.stats().requests, 3);

    // Without any TLS configuration, an https engine is a clear connect error too.
    let err = HttpTransport::default()
        .send(completion(&engine))
        .await
        .unwrap_err();
    let msg = disagg_core::error::error_chain(&err);
    assert!(msg.contains("no TLS configuration"), "{msg}");
}

#[tokio::test]
async fn engines_requiring_client_certificates_get_one() {
    let (ca, clients) = (Ca::new("engines CA"), Ca::new("proxies CA"));
    let engine = https_engine(&ca, Some(&clients), None).await;
    let dir = TempDir::new();
    let client = clients.client("proxy");
    let files = write_pair(&dir, "client", &client);

    let without = transport(
        ClientTls::new(roots(&ca), tls::default_provider()).unwrap(),
        EngineKeys::default(),
    );
    // The engine refuses the handshake; depending on timing the client sees it during
    // the handshake or on its first read: either way no answer comes.
    assert!(without.send(completion(&engine)).await.is_err());
    assert_eq!(engine.stats().requests, 0);
    assert!(engine.stats().tls_handshake_failures >= 1);

    let with = transport(
        ClientTls::with_identity(roots(&ca), files, tls::default_provider()).unwrap(),
        EngineKeys::default(),
    );
    assert_eq!(status(&with, completion(&engine)).await, 200);
    // A client certificate from an untrusted CA is refused like none.
    let stranger = Ca::new("stranger").client("proxy");
    let files = write_pair(&dir, "stranger", &stranger);
    let wrong = transport(
        ClientTls::with_identity(roots(&ca), files, tls::default_provider()).unwrap(),
        EngineKeys::default(),
    );
    assert!(wrong.send(completion(&engine)).await.is_err());
    assert_eq!(engine.stats().requests, 1);
}

#[tokio::test]
async fn the_engine_key_replaces_any_authorization_on_every_request() {
    let ca = Ca::new("engines CA");
    let engine = https_engine(&ca, None, Some("sk-engine")).await;
    let trusting = || ClientTls::new(roots(&ca), tls::default_provider()).unwrap();

    // vLLM's --api-key: the OpenAI routes need it.
    let keyless = transport(trusting(), EngineKeys::default());
    assert_eq!(status(&keyless, completion(&engine)).await, 401);
    assert_eq!(engine.stats().unauthorized, 1);

    let keyed = transport(
        trusting(),
        EngineKeys::default()
            .with_default("sk-wrong")
            .unwrap()
            .with_engine(&engine.url(), "sk-engine")
            .unwrap(),
    );
    let mut req = completion(&engine);
    req.headers_mut()
        .insert("authorization", "Bearer sk-client".parse().unwrap());
    assert_eq!(status(&keyed, req).await, 200);
    let recorded = engine.requests();
    let seen = recorded.last().unwrap();
    assert_eq!(seen.header("authorization"), Some("Bearer sk-engine"));
    // Open paths get the key too (vLLM does not ask for it there).
    let before = engine.stats().requests_without_key;
    let mut health = http::Request::new(Bytes::new());
    *health.uri_mut() = format!("{}/health", engine.url()).parse().unwrap();
    assert_eq!(status(&keyed, health).await, 200);
    assert_eq!(engine.stats().requests_without_key, before);
}

/// Write `pair` as `NAME.crt` and `NAME.key` in `dir` (each by a rename, as a Secret
/// volume swaps its files).
fn write_pair(dir: &TempDir, name: &str, pair: &Pair) -> PemFiles {
    let (cert, key) = dir.pair(name, pair);
    PemFiles::new(cert, key)
}

/// A client TLS connection to the server at `addr` trusting `ca`: the server's
/// certificate, and an HTTP/1.1 sender over the connection.
async fn connect(
    addr: std::net::SocketAddr,
    ca: &Ca,
    alpn: &[&[u8]],
) -> std::io::Result<(
    Vec<u8>,
    hyper::client::conn::http1::SendRequest<Full<Bytes>>,
)> {
    let mut config = rustls::ClientConfig::builder_with_provider(tls::default_provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots(ca))
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let stream = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await?;
    let cert: Vec<u8> = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c: &CertificateDer<'_>| c.to_vec())
        .unwrap_or_default();
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(std::io::Error::other)?;
    tokio::spawn(conn);
    Ok((cert, sender))
}

async fn get(sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>) -> String {
    sender.ready().await.unwrap();
    let req = http::Request::get("/")
        .header("host", "localhost")
        .body(Full::default())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

#[tokio::test]
async fn a_rotated_certificate_serves_new_handshakes_and_open_connections_stay() {
    let ca = Ca::new("edge CA");
    let dir = TempDir::new();
    let (first, second) = (ca.server("first"), ca.server("second"));
    let files = write_pair(&dir, "tls", &first);
    let server_tls = ServerTls::from_files(files.clone(), tls::default_provider()).unwrap();
    let config = server::Builder::new().tls(server_tls.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = tower::service_fn(|_req: http::Request<hyper::body::Incoming>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("hello"))))
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        config
            .serve(listener, app, async {
                let _ = stopped.await;
            })
            .await
    });
    tokio::spawn(server_tls.watch(Duration::from_millis(20)));

    let (cert, mut old) = connect(addr, &ca, &[b"http/1.1"]).await.unwrap();
    assert_eq!(cert, first.der);
    assert_eq!(get(&mut old).await, "hello");

    // An edit that does not load (a key that is not the certificate's: the state between
    // cert-manager's two writes) keeps the first certificate.
    let half = Pair {
        cert: second.cert.clone(),
        key: first.key.clone(),
        der: Vec::new(),
    };
    write_pair(&dir, "tls", &half);
    let refused = tokio::time::timeout(Duration::from_secs(5), async {
        while server_tls.stats().errors == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    refused.await.expect("the mismatched pair is refused");
    let (cert, _) = connect(addr, &ca, &[b"http/1.1"]).await.unwrap();
    assert_eq!(cert, first.der);

    write_pair(&dir, "tls", &second);
    let rotated = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let (cert, _) = connect(addr, &ca, &[b"http/1.1"]).await.unwrap();
            if cert == second.der {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    rotated
        .await
        .expect("new handshakes get the new certificate");
    assert_eq!(server_tls.stats().reloads, 1);
    // The connection opened before the rotation still serves.
    assert_eq!(get(&mut old).await, "hello");

    // Only HTTP/1.1 is offered: a client that wants h2 alone is refused in the handshake.
    assert!(connect(addr, &ca, &[b"h2"]).await.is_err());
    // A client without ALPN gets HTTP/1.1.
    let (_, mut plain) = connect(addr, &ca, &[]).await.unwrap();
    assert_eq!(get(&mut plain).await, "hello");

    drop(stop);
    drop(old);
    drop(plain);
    tokio::time::timeout(Duration::from_secs(10), served)
        .await
        .expect("the server drains")
        .unwrap()
        .unwrap();
}
