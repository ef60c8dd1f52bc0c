//! Certificates for TLS listeners that tests start: a [`TestCa`] that writes its certificate
//! and the server and client certificates it issues as PEM files in a temporary directory.
//!
//! For PostgreSQL ([`PrivateCluster::start_tls`](crate::cluster::PrivateCluster::start_tls)),
//! and for any other server a test runs with TLS (RabbitMQ, a Kafka-protocol broker): the files
//! are what such servers and their clients read (`ssl_cert_file`, `sslrootcert`,
//! `ssl.ca.location`, …). ECDSA P-256 keys in PKCS#8, signed with rcgen's ring backend.
//!
//! ```no_run
//! use txinbox_testing::tls::TestCa;
//!
//! let ca = TestCa::new("my test CA");
//! let server = ca.server(&["localhost", "127.0.0.1"]);
//! let client = ca.client("app");
//! // server.cert, server.key: for the listener; ca.cert_path(): the clients' trust anchor;
//! // client.cert, client.key: a client certificate with common name "app".
//! # let _ = (server, client);
//! ```

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose,
};

/// A certificate authority for one test run: its certificate is written to
/// [`cert_path`](Self::cert_path) as PEM, and every certificate it issues is written beside it.
/// The directory is removed on drop.
pub struct TestCa {
    dir: PathBuf,
    issuer: Issuer<'static, KeyPair>,
    cert: PathBuf,
    issued: AtomicUsize,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa")
            .field("cert", &self.cert)
            .finish_non_exhaustive()
    }
}

/// A certificate and its private key, as PEM files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// The certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PKCS#8 PEM, mode 0600).
    pub key: PathBuf,
}

impl TestCa {
    /// A new CA whose certificate's common name is `name`, in a new temporary directory.
    ///
    /// # Panics
    ///
    /// When the directory or a file cannot be written, or rcgen fails: a test cannot run
    /// without its certificates.
    pub fn new(name: &str) -> TestCa {
        static CAS: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "txinbox-ca-{}-{}",
            std::process::id(),
            CAS.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the test CA's directory");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.distinguished_name = common_name(name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("a CA key");
        let cert = params.self_signed(&key).expect("the self-signed CA certificate");
        let path = dir.join("ca.pem");
        write(&path, &cert.pem());
        TestCa {
            dir,
            issuer: Issuer::new(params, key),
            cert: path,
            issued: AtomicUsize::new(0),
        }
    }

    /// The CA's certificate (PEM): what clients trust (`sslrootcert`, a CA bundle) and what a
    /// server checks client certificates against.
    pub fn cert_path(&self) -> &Path {
        &self.cert
    }

    /// The directory the files are written to.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A server certificate valid for `names`: DNS names, and IP addresses written as such
    /// (`"127.0.0.1"`), with the server-authentication usage.
    pub fn server(&self, names: &[&str]) -> CertFiles {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names.clone()).expect("server certificate names");
        params.distinguished_name = common_name(names.first().map(String::as_str).unwrap_or("server"));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        self.issue(params, "server")
    }

    /// A client certificate with common name `user` (PostgreSQL's `cert` authentication maps
    /// it to the role of that name), with the client-authentication usage.
    pub fn client(&self, user: &str) -> CertFiles {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("client parameters");
        params.distinguished_name = common_name(user);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        self.issue(params, "client")
    }

    fn issue(&self, params: CertificateParams, kind: &str) -> CertFiles {
        let key = KeyPair::generate().expect("a key");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("sign the certificate");
        let n = self.issued.fetch_add(1, Ordering::Relaxed);
        let files = CertFiles {
            cert: self.dir.join(format!("{kind}-{n}.pem")),
            key: self.dir.join(format!("{kind}-{n}.key")),
        };
        write(&files.cert, &cert.pem());
        write(&files.key, &key.serialize_pem());
        restrict(&files.key);
        files
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn common_name(name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    dn
}

fn write(path: &Path, pem: &str) {
    std::fs::write(path, pem).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// Mode 0600: servers (PostgreSQL) and clients (libpq) refuse a private key others can read.
fn restrict(path: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .unwrap_or_else(|e| panic!("chmod 600 {}: {e}", path.display()));
    }
}
