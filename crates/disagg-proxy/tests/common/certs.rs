//! Certificates the TLS tests make themselves (rcgen): CAs, server certificates for
//! `localhost` and `127.0.0.1`, client certificates; files written as a Secret volume
//! swaps them (by rename).

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A test CA.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// Its certificate.
    pub pem: String,
}

/// A certificate and its key as PEM, and the certificate's DER.
pub struct Pair {
    pub cert: String,
    pub key: String,
    pub der: Vec<u8>,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    fn issue(&self, cn: &str, usage: ExtendedKeyUsagePurpose) -> Pair {
        let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Pair {
            cert: cert.pem(),
            key: key.serialize_pem(),
            der: cert.der().to_vec(),
        }
    }

    /// A server certificate for `localhost` and `127.0.0.1`.
    pub fn server(&self, cn: &str) -> Pair {
        self.issue(cn, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate.
    pub fn client(&self, cn: &str) -> Pair {
        self.issue(cn, ExtendedKeyUsagePurpose::ClientAuth)
    }
}

/// A unique temporary directory, removed when dropped.
pub struct TempDir(pub PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl TempDir {
    pub fn new() -> TempDir {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "disagg-proxy-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Write `text` to `name` by a rename (readers never see half a file); its path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path(name);
        write_atomic(&path, text);
        path
    }

    /// Write `pair` as `NAME.crt` and `NAME.key`; their paths.
    pub fn pair(&self, name: &str, pair: &Pair) -> (PathBuf, PathBuf) {
        (
            self.write(&format!("{name}.crt"), &pair.cert),
            self.write(&format!("{name}.key"), &pair.key),
        )
    }
}

pub fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp-write");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}
