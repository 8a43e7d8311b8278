//! HTTPS for the engine's OpenAI server ([`SimConfig::tls`](crate::SimConfig::tls)),
//! optionally requiring client certificates, with rustls and its `ring` provider.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio_rustls::TlsAcceptor;

use crate::config::SimTls;

fn invalid(what: &str, e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("tls {what}: {e}"))
}

fn certs(pem: &str, what: &str) -> std::io::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(what, e))?;
    if certs.is_empty() {
        return Err(invalid(what, "no certificate"));
    }
    Ok(certs)
}

/// The acceptor for `tls`. Like uvicorn (vLLM's server) it offers no ALPN protocol, so
/// clients speak HTTP/1.1.
pub(crate) fn acceptor(tls: &SimTls) -> std::io::Result<TlsAcceptor> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certs(&tls.cert_pem, "certificate")?;
    let key =
        PrivateKeyDer::from_pem_slice(tls.key_pem.as_bytes()).map_err(|e| invalid("key", e))?;
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid("config", e))?;
    let builder = match &tls.client_ca_pem {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs(ca, "client CA")? {
                roots.add(c).map_err(|e| invalid("client CA", e))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| invalid("client CA", e))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(chain, key)
        .map_err(|e| invalid("certificate and key", e))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}
