//! TLS on both sides of the proxy, with rustls: clients served over HTTPS
//! ([`ServerTls`], for [`Builder::tls`](crate::server::Builder::tls)) and
//! `https://` engines reached and verified ([`ClientTls`], for
//! [`HttpTransportConfig::tls`](crate::HttpTransportConfig::tls)).
//!
//! # Crypto provider
//!
//! Every configuration is built with the [`CryptoProvider`] it is given
//! ([`default_provider`]: rustls's `ring` provider, the one the workspace already builds
//! for kube's HTTPS client); nothing reads or installs rustls's process-wide default, so
//! two libraries in one process cannot disagree about it.
//!
//! # HTTP/1.1 over ALPN
//!
//! Both sides offer ALPN `http/1.1` only: the server and the engine transport speak
//! HTTP/1.1 (`hyper`'s `http1`), so a client that asks for `h2` alone is refused in the
//! handshake rather than mid-request.
//!
//! # Certificates reloaded from their files
//!
//! A server certificate (and an engine client certificate) read from PEM files is
//! re-read every poll interval by [`ServerTls::watch`] / [`ClientTls::watch`] and
//! swapped when the files' content changes, as cert-manager rotates a Secret: new
//! handshakes get the new certificate, connections already open keep theirs, nothing
//! restarts. Polling rather than inotify for the reason the key file gives
//! ([`crate::auth`]): a Kubernetes Secret volume swaps a symlink, which a watch on the
//! file never sees. A pair that does not load (unreadable, not PEM, a key that does not
//! match the certificate: cert-manager writes the two files one after the other, and a
//! poll may fall between) keeps the certificate in force; it is logged at `warn` and
//! counted once per distinct content, and the next poll tries again. The last content
//! is remembered as a SHA-256 digest, not as the key's bytes.
//!
//! # Engines
//!
//! An `https://` engine's certificate is verified (chain, validity, and the URL's host,
//! DNS name or IP address, in its subject alternative names) against the roots given:
//! the operating system's trust store ([`native_roots`], which honours `SSL_CERT_FILE`
//! and `SSL_CERT_DIR`), or a private CA ([`roots_from_pem_file`]). The system store and
//! not a bundled list (`webpki-roots`): engines inside a cluster are signed by the
//! cluster's or the company's CA, which operators install in the system store or name
//! with `--engine-ca`, and the system store gets the distribution's updates without a
//! rebuild. A client certificate ([`ClientTls::with_identity`]) answers engines that
//! require one (mTLS). Sessions are resumed from rustls's in-memory cache, and the
//! transport pools TLS connections like plain ones.

use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

pub use rustls;
use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig, SignatureScheme};
use tokio::net::TcpStream;

/// The ALPN protocol both sides offer: the server and the transport speak HTTP/1.1.
const ALPN_HTTP1: &[u8] = b"http/1.1";

/// rustls's `ring` crypto provider, for the configurations of this module.
pub fn default_provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// PEM data could not be decoded.
    #[error("{what}: not valid PEM")]
    Pem {
        /// What was read (a file's path, or what it is for).
        what: String,
        /// Why.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// PEM data holds no certificate.
    #[error("{what}: no certificate (BEGIN CERTIFICATE) found")]
    NoCertificate {
        /// What was read.
        what: String,
    },
    /// PEM data holds no private key.
    #[error("{what}: no private key (BEGIN PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY) found")]
    NoKey {
        /// What was read.
        what: String,
    },
    /// The certificate and key do not make a usable pair (unsupported key type, or a
    /// key that is not the certificate's).
    #[error("the certificate and private key do not make a usable pair")]
    Pair(#[source] rustls::Error),
    /// A root certificate was refused.
    #[error("{what}: a CA certificate was refused")]
    Root {
        /// What was read.
        what: String,
        /// Why.
        #[source]
        source: rustls::Error,
    },
    /// The operating system's trust store gave no usable certificate.
    #[error(
        "no usable root certificate in the system's trust store ({errors} errors while loading it)"
    )]
    NoSystemRoots {
        /// How many errors loading it met.
        errors: usize,
    },
    /// rustls refused the configuration (e.g. a provider with no usable protocol
    /// version).
    #[error("invalid TLS configuration")]
    Config(#[source] rustls::Error),
}

/// A certificate chain and its private key as PEM files: the certificate file holds the
/// end-entity certificate first, then its intermediates (what cert-manager writes as
/// `tls.crt`), the key file the private key (`tls.key`: PKCS#8, PKCS#1 or SEC1).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PemFiles {
    /// The certificate chain.
    pub cert: PathBuf,
    /// The private key.
    pub key: PathBuf,
}

impl PemFiles {
    /// The pair at `cert` and `key`.
    pub fn new(cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        PemFiles {
            cert: cert.into(),
            key: key.into(),
        }
    }
}

/// The largest PEM file read (a CA bundle included): far above any real one.
const MAX_PEM_BYTES: u64 = 16 * 1024 * 1024;

/// How long a reload of certificate files may take before it counts as an error.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// A PEM file's bytes: a regular file only (a FIFO at the path is refused, not waited
/// on, so a reload never blocks on it), at most [`MAX_PEM_BYTES`].
fn read_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    let err = |source| TlsError::Read {
        path: path.to_owned(),
        source,
    };
    disagg_files::read_regular_within(path, MAX_PEM_BYTES).map_err(err)
}

fn certs_from_pem(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            what: what.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            what: what.to_owned(),
        });
    }
    Ok(certs)
}

/// A certified key from PEM: the chain of `cert_pem`, the key of `key_pem`, checked to
/// belong together.
fn certified_key(
    cert_pem: &[u8],
    key_pem: &[u8],
    what: &str,
    provider: &CryptoProvider,
) -> Result<Arc<CertifiedKey>, TlsError> {
    let certs = certs_from_pem(cert_pem, what)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::NoKey {
            what: what.to_owned(),
        },
        source => TlsError::Pem {
            what: what.to_owned(),
            source,
        },
    })?;
    CertifiedKey::from_der(certs, key, provider)
        .map(Arc::new)
        .map_err(TlsError::Pair)
}

// === CertStore ===

/// What the last poll of a pair of files saw, so that each state is logged once.
#[derive(Debug, PartialEq)]
enum Seen {
    /// Content with this digest (loaded, or refused).
    Content([u8; 32]),
    Unreadable,
}

fn digest_pair(cert: &[u8], key: &[u8]) -> [u8; 32] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    // Lengths first, so that moving bytes from one file to the other changes it.
    ctx.update(&(cert.len() as u64).to_le_bytes());
    ctx.update(cert);
    ctx.update(key);
    let mut out = [0u8; 32];
    out.copy_from_slice(ctx.finish().as_ref());
    out
}

/// The certified key in use, swapped by a reload; a rustls resolver for both sides.
struct CertStore {
    current: RwLock<Arc<CertifiedKey>>,
    files: Option<PemFiles>,
    provider: Arc<CryptoProvider>,
    seen: std::sync::Mutex<Option<Seen>>,
    reloads: AtomicU64,
    errors: AtomicU64,
}

impl fmt::Debug for CertStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertStore")
            .field("files", &self.files)
            .field("reloads", &self.reloads.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Counters of a reloaded certificate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReloadStats {
    /// Reloads that swapped the certificate.
    pub reloads: u64,
    /// File states refused (unreadable, invalid, mismatched pair), each counted once.
    pub errors: u64,
}

impl CertStore {
    fn from_pem(cert: &[u8], key: &[u8], provider: Arc<CryptoProvider>) -> Result<Self, TlsError> {
        let ck = certified_key(cert, key, "certificate", &provider)?;
        Ok(Self::with(ck, None, provider, None))
    }

    fn from_files(files: PemFiles, provider: Arc<CryptoProvider>) -> Result<Self, TlsError> {
        let (cert, key) = (read_file(&files.cert)?, read_file(&files.key)?);
        let what = files.cert.display().to_string();
        let ck = certified_key(&cert, &key, &what, &provider)?;
        let seen = Seen::Content(digest_pair(&cert, &key));
        Ok(Self::with(ck, Some(files), provider, Some(seen)))
    }

    fn with(
        ck: Arc<CertifiedKey>,
        files: Option<PemFiles>,
        provider: Arc<CryptoProvider>,
        seen: Option<Seen>,
    ) -> Self {
        CertStore {
            current: RwLock::new(ck),
            files,
            provider,
            seen: std::sync::Mutex::new(seen),
            reloads: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        }
    }

    fn current(&self) -> Arc<CertifiedKey> {
        Arc::clone(
            &self
                .current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Re-read the files; swap the certificate when their content changed and loads.
    /// Blocking (file reads). `Ok(false)`: unchanged, or no files.
    fn reload(&self) -> Result<bool, TlsError> {
        let Some(files) = &self.files else {
            return Ok(false);
        };
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let read = read_file(&files.cert).and_then(|c| Ok((c, read_file(&files.key)?)));
        let (cert, key) = match read {
            Ok(pair) => pair,
            Err(e) => {
                let first = *seen != Some(Seen::Unreadable);
                *seen = Some(Seen::Unreadable);
                if first {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(cert = %files.cert.display(), key = %files.key.display(), error = %disagg_core::error::error_chain(&e), "TLS certificate files unreadable; keeping the certificate in force");
                }
                return Err(e);
            }
        };
        let digest = digest_pair(&cert, &key);
        if *seen == Some(Seen::Content(digest)) {
            return Ok(false);
        }
        *seen = Some(Seen::Content(digest));
        let what = files.cert.display().to_string();
        match certified_key(&cert, &key, &what, &self.provider) {
            Ok(ck) => {
                *self
                    .current
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = ck;
                self.reloads.fetch_add(1, Ordering::Relaxed);
                tracing::info!(cert = %files.cert.display(), "TLS certificate reloaded");
                Ok(true)
            }
            Err(e) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(cert = %files.cert.display(), key = %files.key.display(), error = %disagg_core::error::error_chain(&e), "TLS certificate files refused; keeping the certificate in force");
                Err(e)
            }
        }
    }

    fn stats(&self) -> ReloadStats {
        ReloadStats {
            reloads: self.reloads.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }

    /// Poll the files every `interval` until dropped (reads on the blocking pool).
    /// A reload that has not returned within [`READ_TIMEOUT`] (its files on a hung
    /// volume) is counted as an error once, and no other starts until it returns: the
    /// watch goes on ticking instead of stopping silently.
    async fn watch(self: Arc<Self>, interval: Duration) {
        if self.files.is_none() {
            return;
        }
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        let mut stuck: Option<tokio::task::JoinHandle<Result<bool, TlsError>>> = None;
        loop {
            tick.tick().await;
            let mut running = match stuck.take() {
                Some(t) if !t.is_finished() => {
                    stuck = Some(t);
                    continue;
                }
                _ => {
                    let store = Arc::clone(&self);
                    tokio::task::spawn_blocking(move || store.reload())
                }
            };
            // Its outcome is logged and counted by `reload`.
            if tokio::time::timeout(READ_TIMEOUT, &mut running)
                .await
                .is_err()
            {
                self.errors.fetch_add(1, Ordering::Relaxed);
                let files = self.files.as_ref().map(|f| f.cert.display().to_string());
                tracing::warn!(cert = ?files, "TLS certificate files not read within {READ_TIMEOUT:?}; keeping the certificate in force");
                stuck = Some(running);
            }
        }
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

impl ResolvesClientCert for CertStore {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

// === ServerTls ===

/// HTTPS for a server: a certificate (reloadable from its files) and the rustls
/// configuration around it. Cheap to clone; clones share the certificate.
///
/// # Examples
///
/// ```no_run
/// use disagg_http::server;
/// use disagg_http::tls::{PemFiles, ServerTls, default_provider};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let tls = ServerTls::from_files(PemFiles::new("tls.crt", "tls.key"), default_provider())?;
/// // Pick up rotated certificates.
/// tokio::spawn(tls.watch(std::time::Duration::from_secs(5)));
/// let server = server::Builder::new().tls(tls);
/// # let _ = server;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ServerTls {
    acceptor: tokio_rustls::TlsAcceptor,
    store: Arc<CertStore>,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert", &self.store)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// The certificate and key of `files`, read now; [`watch`](Self::watch) re-reads
    /// them.
    ///
    /// # Errors
    ///
    /// [`TlsError`] when a file cannot be read, holds no PEM certificate or key, or the
    /// two do not belong together.
    pub fn from_files(files: PemFiles, provider: Arc<CryptoProvider>) -> Result<Self, TlsError> {
        let store = CertStore::from_files(files, Arc::clone(&provider))?;
        Self::with_store(store, provider)
    }

    /// A fixed certificate and key from PEM bytes (never reloaded).
    ///
    /// # Errors
    ///
    /// As [`from_files`](Self::from_files).
    pub fn from_pem(
        cert: &[u8],
        key: &[u8],
        provider: Arc<CryptoProvider>,
    ) -> Result<Self, TlsError> {
        let store = CertStore::from_pem(cert, key, Arc::clone(&provider))?;
        Self::with_store(store, provider)
    }

    fn with_store(store: CertStore, provider: Arc<CryptoProvider>) -> Result<Self, TlsError> {
        let store = Arc::new(store);
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Config)?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(&store) as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = vec![ALPN_HTTP1.to_vec()];
        Ok(ServerTls {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            store,
        })
    }

    /// Re-read the files now (blocking) and swap the certificate if they changed:
    /// `Ok(true)` when it was swapped, `Ok(false)` when they are unchanged (or the
    /// certificate came from [`from_pem`](Self::from_pem)).
    ///
    /// # Errors
    ///
    /// [`TlsError`] when the files cannot be used; the certificate in force stays.
    pub fn reload(&self) -> Result<bool, TlsError> {
        self.store.reload()
    }

    /// Re-read the files every `interval` and swap the certificate when they change,
    /// until the future is dropped: run it on the server's runtime (or any other).
    pub fn watch(&self, interval: Duration) -> impl Future<Output = ()> + Send + 'static {
        Arc::clone(&self.store).watch(interval)
    }

    /// Reloads done and refused.
    pub fn stats(&self) -> ReloadStats {
        self.store.stats()
    }

    /// The acceptor for the server's connections.
    pub(crate) fn acceptor(&self) -> &tokio_rustls::TlsAcceptor {
        &self.acceptor
    }
}

// === ClientTls ===

/// The roots of the operating system's trust store (through `rustls-native-certs`,
/// which also reads `SSL_CERT_FILE` and `SSL_CERT_DIR`). Reading it takes a few
/// milliseconds to a few hundred: do it once, at start.
///
/// # Errors
///
/// [`TlsError::NoSystemRoots`] when not one usable certificate was found.
pub fn native_roots() -> Result<RootCertStore, TlsError> {
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        tracing::debug!(error = %e, "a system root certificate could not be loaded");
    }
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        return Err(TlsError::NoSystemRoots {
            errors: found.errors.len(),
        });
    }
    Ok(roots)
}

/// The CA certificates of PEM `pem` as roots; `what` names them in errors.
///
/// # Errors
///
/// [`TlsError`] when the PEM holds no certificate or one that is no usable CA.
pub fn roots_from_pem(pem: &[u8], what: &str) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in certs_from_pem(pem, what)? {
        roots.add(cert).map_err(|source| TlsError::Root {
            what: what.to_owned(),
            source,
        })?;
    }
    Ok(roots)
}

/// The CA certificates of the PEM file at `path` as roots.
///
/// # Errors
///
/// As [`roots_from_pem`], and [`TlsError::Read`].
pub fn roots_from_pem_file(path: &Path) -> Result<RootCertStore, TlsError> {
    roots_from_pem(&read_file(path)?, &path.display().to_string())
}

/// TLS to `https://` engines: the roots their certificates are verified against, and
/// optionally a client certificate (mTLS). Cheap to clone; clones share rustls's
/// session cache.
///
/// # Examples
///
/// ```no_run
/// use disagg_http::{HttpTransport, HttpTransportConfig};
/// use disagg_http::tls::{ClientTls, default_provider, roots_from_pem_file};
///
/// # fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let roots = roots_from_pem_file("engines-ca.pem".as_ref())?;
/// let mut config = HttpTransportConfig::default();
/// config.tls = Some(ClientTls::new(roots, default_provider())?);
/// let transport = HttpTransport::new(config);
/// # let _ = transport;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ClientTls {
    connector: tokio_rustls::TlsConnector,
    identity: Option<Arc<CertStore>>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Verify engines against `roots`, with no client certificate.
    ///
    /// # Errors
    ///
    /// [`TlsError::Config`] when `provider` supports no safe protocol version.
    pub fn new(roots: RootCertStore, provider: Arc<CryptoProvider>) -> Result<Self, TlsError> {
        Self::build(roots, None, provider)
    }

    /// Verify engines against `roots` and present the client certificate of `identity`
    /// to those that ask for one; [`watch`](Self::watch) re-reads its files.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new), and as [`ServerTls::from_files`] for the certificate.
    pub fn with_identity(
        roots: RootCertStore,
        identity: PemFiles,
        provider: Arc<CryptoProvider>,
    ) -> Result<Self, TlsError> {
        let store = Arc::new(CertStore::from_files(identity, Arc::clone(&provider))?);
        Self::build(roots, Some(store), provider)
    }

    fn build(
        roots: RootCertStore,
        identity: Option<Arc<CertStore>>,
        provider: Arc<CryptoProvider>,
    ) -> Result<Self, TlsError> {
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Config)?
            .with_root_certificates(roots);
        let mut config = match &identity {
            Some(store) => {
                builder.with_client_cert_resolver(Arc::clone(store) as Arc<dyn ResolvesClientCert>)
            }
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![ALPN_HTTP1.to_vec()];
        Ok(ClientTls {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            identity,
        })
    }

    /// Re-read the client certificate's files every `interval` and swap it when they
    /// change, until dropped; ends at once without a client certificate.
    pub fn watch(&self, interval: Duration) -> impl Future<Output = ()> + Send + 'static {
        let identity = self.identity.clone();
        async move {
            if let Some(store) = identity {
                store.watch(interval).await;
            }
        }
    }

    /// Reloads of the client certificate done and refused.
    pub fn stats(&self) -> ReloadStats {
        self.identity
            .as_ref()
            .map(|s| s.stats())
            .unwrap_or_default()
    }

    /// The TLS handshake with `host` over `stream`.
    pub(crate) async fn connect(
        &self,
        host: &str,
        stream: TcpStream,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>, disagg_core::error::BoxError> {
        let name = ServerName::try_from(host.to_owned())?;
        Ok(self.connector.connect(name, stream).await?)
    }
}
