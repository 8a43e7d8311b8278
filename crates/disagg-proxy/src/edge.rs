//! `serve`'s flags at the edge: the clients' API keys and their limits, HTTPS to
//! clients, and the engines' keys and TLS (docs/security.md).

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use disagg_http::HttpTransportConfig;
use disagg_http::auth::{ApiKeyLayer, ApiKeys, EngineKeys, KeyFile, KeyLimits};
use disagg_http::metrics::ExtraMetrics;
use disagg_http::tls::{self, ClientTls, PemFiles, ReloadStats, ServerTls};

use crate::BoxError;

/// A key from the command line: `Debug` never shows it (the flags may be logged whole).
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

/// An engine key: `URL=KEY` for one engine, or `KEY` for all the others.
#[derive(Clone)]
pub struct EngineKeyArg {
    url: Option<String>,
    key: Secret,
}

impl fmt::Debug for EngineKeyArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineKeyArg")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

fn parse_engine_key(s: &str) -> Result<EngineKeyArg, String> {
    // A URL names an engine; a key never starts like one, so `KEY` alone is the default.
    if s.starts_with("http://") || s.starts_with("https://") {
        let (url, key) = s
            .split_once('=')
            .ok_or_else(|| "an engine key for one engine is URL=KEY".to_owned())?;
        return Ok(EngineKeyArg {
            url: Some(url.trim_end_matches('/').to_owned()),
            key: Secret(key.to_owned()),
        });
    }
    Ok(EngineKeyArg {
        url: None,
        key: Secret(s.to_owned()),
    })
}

/// Flags of the edge: client keys, limits per key, TLS in and out, engine keys.
#[derive(Debug, Clone, Args)]
pub struct EdgeArgs {
    /// A key clients must send as `Authorization: Bearer KEY` (repeatable). Every route
    /// but GET /health (and /metrics, see --metrics-api-key) then needs one; others are
    /// answered 401 before their body is read. Keys on the command line are visible to
    /// the machine's other users (`ps`): prefer --api-key-file.
    #[arg(long = "api-key", value_name = "KEY")]
    api_keys: Vec<Secret>,
    /// A file of client keys, one per line (`#` comments and blank lines ignored),
    /// re-read every --reload-interval: an edit is in force within two intervals, and
    /// an unreadable or invalid edit keeps the keys in force (logged, counted in
    /// /metrics). Adds to --api-key. An empty file refuses every client.
    #[arg(long, value_name = "PATH")]
    api_key_file: Option<PathBuf>,
    /// The key GET /metrics needs (default: /metrics is open); client keys do not open it.
    #[arg(long, value_name = "KEY")]
    metrics_api_key: Option<Secret>,
    /// Requests one client key may have in flight (streams count until they end); one
    /// more is answered 429 with `retry-after: 1`. Other keys are unaffected.
    #[arg(long, value_name = "N")]
    key_max_in_flight: Option<usize>,
    /// Requests per second one client key may start (a token bucket); past it, 429 with
    /// `retry-after` (seconds until the next token, rounded up).
    #[arg(long, value_name = "R")]
    key_rate: Option<f64>,
    /// How many requests a key that was idle may start at once under --key-rate
    /// (default: max(1, R), one second's worth).
    #[arg(long, value_name = "N")]
    key_burst: Option<f64>,
    /// Serve HTTPS with this certificate chain (PEM, end-entity first; cert-manager's
    /// tls.crt), re-read every --reload-interval: new connections get a rotated
    /// certificate, open ones keep theirs.
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Seconds between two reads of --api-key-file, --tls-cert/--tls-key and
    /// --engine-client-cert/--engine-client-key.
    #[arg(long, value_name = "SECS", default_value_t = 2.0)]
    reload_interval: f64,
    /// The key sent to engines as `Authorization: Bearer KEY` (their --api-key), on
    /// both legs, GET /v1/models, health checks, Mooncake's /query and LMCache's
    /// /tokenize; URL=KEY gives one engine its own key (every rank of it). Repeatable.
    /// A client's own authorization never reaches an engine. At most one KEY, and one
    /// URL=KEY per engine.
    #[arg(long = "engine-api-key", value_name = "[URL=]KEY", value_parser = parse_engine_key)]
    engine_api_keys: Vec<EngineKeyArg>,
    /// Verify https:// engines against the CA certificates of this PEM file only
    /// (default: the system's trust store, SSL_CERT_FILE and SSL_CERT_DIR honoured).
    #[arg(long, value_name = "PATH")]
    engine_ca: Option<PathBuf>,
    /// A client certificate (PEM) for https:// engines that require one (mTLS),
    /// re-read every --reload-interval.
    #[arg(long, value_name = "PATH", requires = "engine_client_key")]
    engine_client_cert: Option<PathBuf>,
    /// The private key of --engine-client-cert.
    #[arg(long, value_name = "PATH", requires = "engine_client_cert")]
    engine_client_key: Option<PathBuf>,
}

/// What the edge flags make: the layer in front of the service, the server's TLS, the
/// transport's TLS and keys, and what must be reloaded.
#[derive(Debug, Default)]
pub(crate) struct Edge {
    /// The key check, when any key is configured.
    pub(crate) layer: Option<ApiKeyLayer>,
    /// HTTPS to clients.
    pub(crate) server_tls: Option<ServerTls>,
    client_tls: Option<ClientTls>,
    engine_keys: EngineKeys,
    /// The client keys, for the key file's reloads and the metrics.
    keys: Option<ApiKeys>,
    key_file: Option<KeyFile>,
    interval: Duration,
}

impl EdgeArgs {
    /// Whether clients need a key.
    pub(crate) fn client_keys(&self) -> bool {
        !self.api_keys.is_empty() || self.api_key_file.is_some()
    }

    /// The edge's time flags, by name, for the checks made before anything is built.
    pub(crate) fn time_flags(&self) -> [(&'static str, f64); 1] {
        [("reload-interval", self.reload_interval)]
    }

    /// `--engine-api-key` names each engine (compared without `@RANK` and trailing `/`,
    /// as the keys are looked up) at most once, and gives at most one default key: a
    /// second value would silently replace the first. The keys themselves are never
    /// shown.
    pub(crate) fn check_once_per_engine(&self) -> Result<(), BoxError> {
        if self
            .engine_api_keys
            .iter()
            .filter(|k| k.url.is_none())
            .count()
            > 1
        {
            return Err(
                "--engine-api-key KEY (the key of every engine not named) is given twice: give it once"
                    .into(),
            );
        }
        let urls = self.engine_api_keys.iter().filter_map(|k| k.url.as_deref());
        match crate::serve::repeated(urls.map(base)) {
            Some(url) => Err(format!(
                "--engine-api-key is given twice for {url}: give it once per engine"
            )
            .into()),
            None => Ok(()),
        }
    }

    /// Build the edge for engines at `engine_urls`; `discovery` says whether more engines
    /// may be found at run time (an engine key may then name one not listed, and
    /// `https://` engines may appear).
    ///
    /// # Errors
    ///
    /// Invalid keys or key file, unusable certificates, limits out of range, an engine
    /// key naming no engine, https engines and no usable trust store.
    pub(crate) fn build<'a>(
        &self,
        mut engine_urls: impl Iterator<Item = &'a str> + Clone,
        discovery: bool,
    ) -> Result<Edge, BoxError> {
        let interval = crate::serve::secs(self.reload_interval, "reload-interval")?;
        if interval.is_zero() {
            return Err("--reload-interval must be a positive number of seconds".into());
        }
        let limits = self.limits()?;
        let mut edge = Edge {
            interval,
            ..Edge::default()
        };
        if self.client_keys() {
            let keys = ApiKeys::with_limits(self.api_keys.iter().map(Secret::expose), limits)
                .map_err(|e| format!("--api-key: {e}"))?;
            if let Some(path) = &self.api_key_file {
                let mut file = KeyFile::new(path);
                file.poll_interval = interval;
                let loaded = file
                    .read()
                    .map_err(|e| format!("--api-key-file: {}", chain(&e)))?;
                keys.reload(&loaded)
                    .map_err(|e| format!("--api-key-file: {e}"))?;
                edge.key_file = Some(file);
            }
            if keys.is_empty() {
                tracing::warn!(
                    "no client API key in force: every request but GET /health is refused"
                );
            }
            edge.layer = Some(ApiKeyLayer::new(keys.clone()));
            edge.keys = Some(keys);
        } else if limits != KeyLimits::default() {
            return Err("--key-max-in-flight, --key-rate and --key-burst need client keys (--api-key or --api-key-file)".into());
        }
        if let Some(key) = &self.metrics_api_key {
            let metrics =
                ApiKeys::new([key.expose()]).map_err(|e| format!("--metrics-api-key: {e}"))?;
            edge.layer = Some(match edge.layer.take() {
                Some(layer) => layer.metrics_keys(metrics),
                None => ApiKeyLayer::metrics_only(metrics),
            });
        }
        let provider = tls::default_provider();
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            let files = PemFiles::new(cert, key);
            edge.server_tls = Some(
                ServerTls::from_files(files, Arc::clone(&provider))
                    .map_err(|e| format!("--tls-cert/--tls-key: {}", chain(&e)))?,
            );
        }
        for k in &self.engine_api_keys {
            edge.engine_keys = match &k.url {
                None => edge.engine_keys.with_default(k.key.expose()),
                Some(url) => {
                    // Without discovery a URL naming no engine is a typo; with it, the
                    // engine may be found later.
                    if !discovery && !engine_urls.clone().any(|u| base(u) == url) {
                        return Err(format!(
                            "--engine-api-key names {url}, which is no --prefill or --decode engine"
                        )
                        .into());
                    }
                    edge.engine_keys.with_engine(url, k.key.expose())
                }
            }
            .map_err(|e| format!("--engine-api-key: {e}"))?;
        }
        let https = engine_urls.any(|u| u.starts_with("https://"));
        if https || discovery || self.engine_ca.is_some() || self.engine_client_cert.is_some() {
            let roots = match &self.engine_ca {
                Some(path) => tls::roots_from_pem_file(path)
                    .map_err(|e| format!("--engine-ca: {}", chain(&e)))?,
                None => match tls::native_roots() {
                    Ok(roots) => roots,
                    // Discovery alone does not say an engine will speak https: without a
                    // trust store, plain engines still work and an https one fails its
                    // requests with a clear error.
                    Err(e) if !https && discovery && self.engine_client_cert.is_none() => {
                        tracing::warn!(
                            "no trust store for https engines found by discovery: {}; name their CA with --engine-ca",
                            chain(&e)
                        );
                        return Ok(edge);
                    }
                    Err(e) => {
                        return Err(format!(
                            "https engines: {}; name their CA with --engine-ca",
                            chain(&e)
                        )
                        .into());
                    }
                },
            };
            let client = match (&self.engine_client_cert, &self.engine_client_key) {
                (Some(cert), Some(key)) => {
                    ClientTls::with_identity(roots, PemFiles::new(cert, key), provider).map_err(
                        |e| format!("--engine-client-cert/--engine-client-key: {}", chain(&e)),
                    )?
                }
                _ => ClientTls::new(roots, provider).map_err(|e| chain(&e))?,
            };
            edge.client_tls = Some(client);
        }
        Ok(edge)
    }

    fn limits(&self) -> Result<KeyLimits, BoxError> {
        let mut limits = KeyLimits::default();
        if self.key_max_in_flight == Some(0) {
            return Err("--key-max-in-flight must be at least 1".into());
        }
        limits.max_in_flight = self.key_max_in_flight;
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if let Some(r) = self.key_rate {
            if !positive(r) {
                return Err("--key-rate must be a positive number of requests per second".into());
            }
            limits.rate = Some(r);
        }
        if let Some(b) = self.key_burst {
            if self.key_rate.is_none() {
                return Err("--key-burst needs --key-rate".into());
            }
            if !(b.is_finite() && b >= 1.0) {
                return Err("--key-burst must be at least 1".into());
            }
            limits.burst_size = Some(b);
        }
        Ok(limits)
    }
}

fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    disagg_core::error::error_chain(e)
}

/// `url` without a `@RANK` suffix and a trailing `/`.
fn base(url: &str) -> &str {
    let base = match url.rsplit_once('@') {
        Some((base, ranks)) if ranks.bytes().all(|b| b.is_ascii_digit() || b == b'-') => base,
        _ => url,
    };
    base.trim_end_matches('/')
}

impl Edge {
    /// Give `config` the engines' keys and TLS.
    pub(crate) fn apply(&self, config: &mut HttpTransportConfig) {
        config.engine_keys = self.engine_keys.clone();
        config.tls = self.client_tls.clone();
    }

    /// The edge's counters for GET /metrics: the client keys' refusals and reloads, the
    /// certificates' reloads. Counts only, no key material.
    pub(crate) fn metrics(&self) -> Option<ExtraMetrics> {
        let keys = self.keys.clone();
        let server = self.server_tls.clone();
        let client = self.client_tls.clone();
        if keys.is_none() && server.is_none() && client.is_none() {
            return None;
        }
        Some(ExtraMetrics::new(move |registry| {
            if let Some(k) = &keys {
                k.register_metrics(registry);
            }
            if server.is_some() || client.is_some() {
                registry.register_collector(Box::new(TlsCollector {
                    server: server.clone(),
                    client: client.clone(),
                }));
            }
        }))
    }

    /// The reloads to run until shutdown (the key file, the certificates' files), or
    /// `None` when nothing is reloadable.
    pub(crate) fn reloads(&self) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        let keys = match (&self.keys, &self.key_file) {
            (Some(k), Some(f)) => Some(k.watch(f.clone())),
            _ => None,
        };
        let server = self.server_tls.as_ref().map(|t| t.watch(self.interval));
        let client = self.client_tls.as_ref().map(|t| t.watch(self.interval));
        if keys.is_none() && server.is_none() && client.is_none() {
            return None;
        }
        Some(async move {
            let keys = async move {
                if let Some(k) = keys {
                    k.await;
                }
            };
            let server = async move {
                if let Some(s) = server {
                    s.await;
                }
            };
            let client = async move {
                if let Some(c) = client {
                    c.await;
                }
            };
            futures::join!(keys, server, client);
        })
    }
}

/// How long a reload thread's runtime waits, at shutdown, for work on its blocking
/// pool (a certificate being read): a read that hangs on its file must not keep the
/// process from exiting.
pub(crate) const RUNTIME_SHUTDOWN: Duration = Duration::from_secs(1);

/// Run `work` on a thread of its own (a small event loop) until `shutdown` turns `true`;
/// the runtime then waits at most [`RUNTIME_SHUTDOWN`] for its blocking work.
///
/// # Errors
///
/// When the thread or its runtime cannot start.
pub(crate) fn spawn_until(
    name: &str,
    work: impl std::future::Future<Output = ()> + Send + 'static,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> Result<std::thread::JoinHandle<()>, BoxError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            runtime.block_on(async move {
                tokio::select! {
                    () = work => {}
                    _ = shutdown.wait_for(|stop| *stop) => {}
                }
            });
            runtime.shutdown_timeout(RUNTIME_SHUTDOWN);
        })?)
}

/// One of a certificate's reload counts.
type ReloadCount = fn(&ReloadStats) -> u64;

/// The certificates' reload counters, read at each scrape: `disagg_tls_reloads_total`
/// and `disagg_tls_reload_errors_total`, labelled `cert="server"` (the proxy's own) and
/// `cert="engine_client"` (the one it shows the engines), each only when configured.
struct TlsCollector {
    server: Option<ServerTls>,
    client: Option<ClientTls>,
}

impl fmt::Debug for TlsCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsCollector")
            .field("server", &self.server.is_some())
            .field("client", &self.client.is_some())
            .finish()
    }
}

impl prometheus_client::collector::Collector for TlsCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::counter::ConstCounter;
        let rows = [
            ("server", self.server.as_ref().map(ServerTls::stats)),
            ("engine_client", self.client.as_ref().map(ClientTls::stats)),
        ];
        let families: [(&str, &str, ReloadCount); 2] = [
            (
                "disagg_tls_reloads",
                "Certificates reloaded from their files.",
                |s| s.reloads,
            ),
            (
                "disagg_tls_reload_errors",
                "Certificate file states refused (unreadable, invalid, mismatched).",
                |s| s.errors,
            ),
        ];
        // Counters are named without `_total`: the encoders append it.
        for (name, help, value) in families {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (cert, stats) in rows.iter().filter_map(|(c, s)| s.as_ref().map(|s| (c, s))) {
                ConstCounter::new(value(stats))
                    .encode(family.encode_family(&[("cert", *cert)])?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_keys_parse_with_and_without_a_url() {
        let k = parse_engine_key("sk-all").unwrap();
        assert!(k.url.is_none());
        assert_eq!(k.key.expose(), "sk-all");
        let k = parse_engine_key("https://d:1/=sk=one").unwrap();
        assert_eq!(k.url.as_deref(), Some("https://d:1"));
        assert_eq!(k.key.expose(), "sk=one");
        assert!(parse_engine_key("http://d:1").is_err());
        assert!(!format!("{k:?}").contains("sk=one"));
    }
}
