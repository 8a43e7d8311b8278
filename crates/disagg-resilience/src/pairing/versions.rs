//! Engine versions, for the connectors whose handshake compares them
//! ([`KvConnector::equal_versions`]: vLLM NIXL and Mooncake): read from the engine's
//! `GET /version` ([`read_version`]) and compared per pair ([`check_versions`]).
//! Moved here from `disagg_core::pairing` (issue #31): reading an engine is
//! enforcement's I/O, and the core keeps the declared facts.

use std::time::Duration;

use bytes::Bytes;
use disagg_core::connector::KvConnector;
use disagg_core::endpoint::Endpoint;
use disagg_core::error::TransportError;
use disagg_core::transport::{Transport, read_limited};
use disagg_pairing::Mismatch;

/// The path engines answer their version on: vLLM's `GET /version`,
/// `{"version": "0.33.0"}` (`vllm/entrypoints/serve/instrumentator/basic.py`).
pub const VERSION_PATH: &str = "/version";

/// The largest `/version` answer read: the JSON of one short string.
const MAX_VERSION_BODY: usize = 4096;

/// The longest version string taken.
const MAX_VERSION_CHARS: usize = 128;

/// Check one pair's engine versions (each `None` when the engine did not tell it)
/// against `connector`: for a connector that needs them equal
/// ([`KvConnector::equal_versions`]), two known
/// versions must be equal; an unknown one is not checked.
///
/// # Errors
///
/// [`Mismatch::Versions`].
pub fn check_versions(
    prefill: Option<&str>,
    decode: Option<&str>,
    connector: &dyn KvConnector,
) -> Result<(), Mismatch> {
    match (prefill, decode) {
        (Some(p), Some(d)) if p != d && connector.equal_versions() => Err(Mismatch::Versions {
            connector: connector.name(),
            prefill: p.to_owned(),
            decode: d.to_owned(),
        }),
        _ => Ok(()),
    }
}

/// Why an engine's version is not known.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VersionError {
    /// No answer: the engine could not be reached, or broke off.
    #[error("GET {VERSION_PATH} failed")]
    Transport(#[source] TransportError),
    /// No answer within the timeout.
    #[error("GET {VERSION_PATH} did not answer within {0:?}")]
    Timeout(Duration),
    /// An answer other than 200.
    #[error("GET {VERSION_PATH} answered {0}")]
    Status(http::StatusCode),
    /// A body that is not `{"version": "..."}` with a short printable string.
    #[error("GET {VERSION_PATH} answered no usable version: {0}")]
    Body(String),
}

/// Reads `endpoint`'s engine version with `GET /version` through `transport`, within
/// `timeout`. The body is read up to 4 KiB and the version taken only as a printable
/// string of at most 128 characters: an engine's answer is not trusted further.
///
/// # Errors
///
/// [`VersionError`]: the engine's version is then unknown (and not checked).
pub async fn read_version(
    transport: &dyn Transport,
    endpoint: &Endpoint,
    timeout: Duration,
) -> Result<String, VersionError> {
    let uri = endpoint
        .uri(VERSION_PATH)
        .map_err(|e| VersionError::Body(e.to_string()))?;
    let mut req = http::Request::new(Bytes::new());
    *req.uri_mut() = uri;
    let sent = transport.send(req);
    let exchange = async move {
        let resp = sent.await.map_err(VersionError::Transport)?;
        let status = resp.status();
        let body = read_limited(resp.into_body(), MAX_VERSION_BODY).await;
        if status != http::StatusCode::OK {
            return Err(VersionError::Status(status));
        }
        let body = body.map_err(|e| VersionError::Body(e.to_string()))?;
        parse_version(&body)
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or(Err(VersionError::Timeout(timeout)))
}

/// The version of a `/version` body.
fn parse_version(body: &[u8]) -> Result<String, VersionError> {
    #[derive(serde::Deserialize)]
    struct Answer {
        version: String,
    }
    let a: Answer = serde_json::from_slice(body).map_err(|e| VersionError::Body(e.to_string()))?;
    let v = a.version.trim();
    let printable = v.chars().all(|c| c.is_ascii_graphic());
    if v.is_empty() || v.len() > MAX_VERSION_CHARS || !printable {
        return Err(VersionError::Body(format!(
            "the version is not 1 to {MAX_VERSION_CHARS} printable ASCII characters"
        )));
    }
    Ok(v.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_short_printable_version_is_taken() {
        assert_eq!(
            parse_version(br#"{"version": "0.33.0"}"#).unwrap(),
            "0.33.0"
        );
        assert_eq!(
            parse_version(br#"{"version": " 0.5.23 ", "extra": 1}"#).unwrap(),
            "0.5.23"
        );
        for bad in [
            &br#"{"version": ""}"#[..],
            br#"{"version": 33}"#,
            br#"{"v": "1"}"#,
            br#"{"version": "a b"}"#,
            b"not json",
        ] {
            assert!(
                parse_version(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let long = format!(r#"{{"version": "{}"}}"#, "9".repeat(129));
        assert!(parse_version(long.as_bytes()).is_err());
    }
}
