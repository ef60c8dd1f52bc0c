//! [`AmqpTls`]: the certificates of an `amqps://` connection, and the one place every connection
//! of this crate (the source, the outbox publisher, the `txinbox` CLI) is opened:
//! [`AmqpTls::connect`].

use std::fmt;
use std::path::{Path, PathBuf};

use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::uri::SASLMechanism;
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};

use crate::error::AmqpError;

/// TLS settings of an `amqps://` connection: a CA to trust and a client certificate.
///
/// Without any, `amqps://` verifies the broker against the system's root certificates (right
/// for CloudAMQP, Amazon MQ and any broker with a public certificate). Set
/// [`ca_file`](Self::ca_file) for a broker whose certificate a private CA signed, and
/// [`client_certificate`](Self::client_certificate) when the broker asks for one, e.g. to log
/// in with it (SASL `EXTERNAL`: add `?auth_mechanism=external` to the URI, leave out user and
/// password; RabbitMQ's plugin `rabbitmq_auth_mechanism_ssl`).
///
/// The broker's certificate is always verified (chain and host name); there is no switch to
/// turn that off. The files are read at every connect, so a renewed certificate is picked up at
/// the next reconnect. `Debug` shows the paths, never the files' contents.
///
/// ```no_run
/// use txinbox_amqp::{AmqpConfig, AmqpTls};
/// let tls = AmqpTls::new()
///     .ca_file("/etc/txinbox/ca.pem")
///     .client_certificate("/etc/txinbox/client.pem", "/etc/txinbox/client.key");
/// let config = AmqpConfig::new("amqps://broker.internal:5671/%2f?auth_mechanism=external", "payments")
///     .tls(tls);
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct AmqpTls {
    ca_file: Option<PathBuf>,
    client_certificate: Option<(PathBuf, PathBuf)>,
}

impl AmqpTls {
    /// No CA of its own, no client certificate: the system's root certificates verify the
    /// broker.
    pub fn new() -> Self {
        AmqpTls::default()
    }

    /// Trusts the CA certificates of this PEM file (one or more) in addition to the system's
    /// root certificates.
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// Presents this client certificate (PEM, optionally followed by its chain) with its
    /// private key (PEM: PKCS#8, PKCS#1 or SEC1, unencrypted) when the broker asks for one.
    pub fn client_certificate(mut self, certificate: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client_certificate = Some((certificate.into(), key.into()));
        self
    }

    /// Whether nothing is set (system roots, no client certificate).
    pub fn is_default(&self) -> bool {
        self.ca_file.is_none() && self.client_certificate.is_none()
    }

    /// Opens a connection to `uri` with these settings (validated first). The error says what to
    /// change: a broker certificate no trusted CA signed, a host name it does not cover, a
    /// plaintext `amqp://` URI to a TLS port or the other way round. Never shows the password.
    pub async fn connect(
        &self,
        uri: &str,
        properties: ConnectionProperties,
    ) -> Result<Connection, AmqpError> {
        let parsed = self.check(uri, "URI")?;
        let tls = self.load()?;
        let runtime = lapin::runtime::default_runtime().map_err(|e| broker(e, &parsed))?;
        Connection::connect_uri_with_config(parsed.clone(), properties, tls, runtime)
            .await
            .map_err(|e| broker(e, &parsed))
    }

    /// Checks `uri` (an AMQP URI, `amqps://` when anything is set) and that the files exist;
    /// `what` names the setting in the error.
    pub(crate) fn check(&self, uri: &str, what: &str) -> Result<AMQPUri, AmqpError> {
        let redacted = txinbox::redact::url(uri);
        // NOTE: parsed here first: lapin's own parse error quotes the whole URI, password included.
        let parsed: AMQPUri = uri.parse().map_err(|e: String| {
            // …and so does the reason it gives: say it with the password masked.
            let e = e.replace(uri, &redacted);
            AmqpError::Config(format!(
                "{what} {redacted} is not an AMQP URI ({e}); expected amqp://user:password@host:5672/%2f or amqps://…"
            ))
        })?;
        if parsed.scheme == AMQPScheme::AMQP && !self.is_default() {
            return Err(AmqpError::Config(format!(
                "a TLS CA file or client certificate is set, but {what} {redacted} is plaintext amqp://; use amqps:// (port 5671 by default)"
            )));
        }
        let files = self
            .ca_file
            .iter()
            .chain(self.client_certificate.iter().flat_map(|(cert, key)| [cert, key]));
        for file in files {
            if !file.is_file() {
                return Err(AmqpError::Config(format!(
                    "TLS file {} does not exist or is not a file",
                    file.display()
                )));
            }
        }
        Ok(parsed)
    }

    /// Reads the files into lapin's TLS configuration.
    fn load(&self) -> Result<OwnedTLSConfig, AmqpError> {
        let mut config = OwnedTLSConfig::default();
        if let Some(path) = &self.ca_file {
            let pem = read(path)?;
            let text = String::from_utf8(pem).map_err(|_| not_pem(path, "CERTIFICATE"))?;
            // NOTE: lapin (tcp-stream) skips what it cannot parse without a word: a file with no
            // certificate would silently trust nothing more.
            if !text.contains("-----BEGIN CERTIFICATE-----") {
                return Err(not_pem(path, "CERTIFICATE"));
            }
            config.cert_chain = Some(text);
        }
        if let Some((cert, key)) = &self.client_certificate {
            let pem = read(cert)?;
            if !contains(&pem, b"-----BEGIN CERTIFICATE-----") {
                return Err(not_pem(cert, "CERTIFICATE"));
            }
            let key_pem = read(key)?;
            if !contains(&key_pem, b"PRIVATE KEY-----") {
                return Err(not_pem(key, "PRIVATE KEY"));
            }
            if contains(&key_pem, b"ENCRYPTED PRIVATE KEY") {
                return Err(AmqpError::Config(format!(
                    "TLS client key {} is encrypted; give an unencrypted key (e.g. openssl pkcs8 -nocrypt)",
                    key.display()
                )));
            }
            config.identity = Some(OwnedIdentity::PKCS8 { pem, key: key_pem });
        }
        Ok(config)
    }
}

impl fmt::Debug for AmqpTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpTls")
            .field("ca_file", &self.ca_file)
            .field("client_certificate", &self.client_certificate)
            .finish()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, AmqpError> {
    std::fs::read(path)
        .map_err(|e| AmqpError::Config(format!("cannot read TLS file {}: {e}", path.display())))
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn not_pem(path: &Path, what: &str) -> AmqpError {
    AmqpError::Config(format!(
        "TLS file {} holds no PEM {what} (-----BEGIN {what}-----)",
        path.display()
    ))
}

/// A connect failure as an [`AmqpError::Broker`], fatal when retrying cannot help, with a hint
/// when it is a TLS matter ([`tls_hint`]).
fn broker(e: lapin::Error, uri: &AMQPUri) -> AmqpError {
    let fatal = crate::source::is_fatal(&e);
    match tls_hint(&e, uri) {
        Some((hint, tls_fatal)) => AmqpError::Broker {
            context: "connect".into(),
            fatal: fatal || tls_fatal,
            source: Box::new(crate::error::Advised::new(e, hint)),
        },
        None => AmqpError::Broker {
            context: "connect".into(),
            fatal,
            source: Box::new(e),
        },
    }
}

/// What to do about a connect error that comes from TLS (or its absence), and whether it is
/// fatal (a certificate the client does not trust will not become trusted by retrying).
fn tls_hint(e: &lapin::Error, uri: &AMQPUri) -> Option<(String, bool)> {
    let host = &uri.authority.host;
    let port = uri.authority.port;
    let plaintext_to_tls = || {
        (
            format!("{host}:{port} did not answer with AMQP; if it is a TLS port (5671), use amqps://"),
            false,
        )
    };
    let io = match e.kind() {
        lapin::ErrorKind::IOError(io) => io,
        // A TLS server's alert read as an AMQP frame.
        lapin::ErrorKind::ParsingError(_) if uri.scheme == AMQPScheme::AMQP => return Some(plaintext_to_tls()),
        lapin::ErrorKind::ProtocolError(amqp)
            if uri.query.auth_mechanism == Some(SASLMechanism::External)
                && matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)) =>
        {
            return Some((
                "EXTERNAL logs in with the client certificate: give one (AmqpTls::client_certificate, --amqp-client-cert and --amqp-client-key) whose subject names a user of the broker (RabbitMQ: plugin rabbitmq_auth_mechanism_ssl, ssl_cert_login_from)".into(),
                true,
            ))
        }
        _ => return None,
    };
    if let Some(tls) = io
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        use rustls::CertificateError as C;
        return Some(match tls {
            rustls::Error::InvalidCertificate(C::UnknownIssuer | C::BadSignature) => (
                format!("the broker's certificate ({host}:{port}) is not signed by a CA this client trusts; give the CA that signed it (AmqpTls::ca_file, --amqp-ca-file)"),
                true,
            ),
            rustls::Error::InvalidCertificate(C::NotValidForName | C::NotValidForNameContext { .. }) => (
                format!("the broker's certificate is not valid for the host name {host:?}; connect with a name the certificate lists"),
                true,
            ),
            rustls::Error::InvalidCertificate(C::Expired | C::ExpiredContext { .. } | C::NotValidYet | C::NotValidYetContext { .. }) => (
                "the broker's certificate is expired or not yet valid (check its dates and this machine's clock)".to_string(),
                true,
            ),
            rustls::Error::InvalidCertificate(_) => (
                format!("the broker's certificate ({host}:{port}) was refused"),
                true,
            ),
            rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } => (
                format!("{host}:{port} did not answer with TLS; if it is a plaintext port (5672), use amqp://, else check the port"),
                true,
            ),
            rustls::Error::AlertReceived(alert) => (
                format!("the broker refused the TLS handshake ({alert:?}); if it asks for a client certificate, give one (AmqpTls::client_certificate, --amqp-client-cert and --amqp-client-key) signed by a CA the broker trusts"),
                true,
            ),
            _ => return None,
        });
    }
    let closed = matches!(
        io.kind(),
        std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
    );
    (closed && uri.scheme == AMQPScheme::AMQP).then(plaintext_to_tls)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_files_on_a_plaintext_uri_are_refused() {
        let e = AmqpTls::new()
            .ca_file("/nonexistent.pem")
            .check("amqp://u:s3cret@h:5672/%2f", "uri")
            .unwrap_err()
            .to_string();
        assert!(e.contains("use amqps://") && !e.contains("s3cret"), "{e}");
        AmqpTls::new().check("amqp://u:p@h/%2f", "uri").unwrap();
    }

    #[test]
    fn missing_or_wrong_files_are_named() {
        let e = AmqpTls::new()
            .ca_file("/nonexistent/ca.pem")
            .check("amqps://h/%2f", "uri")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/nonexistent/ca.pem") && e.contains("does not exist"),
            "{e}"
        );

        let dir = std::env::temp_dir().join(format!("txinbox-amqp-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let e = AmqpTls::new().ca_file(&junk).load().unwrap_err().to_string();
        assert!(
            e.contains("holds no PEM CERTIFICATE") && e.contains("junk.pem"),
            "{e}"
        );
        let e = AmqpTls::new()
            .client_certificate(&junk, &junk)
            .load()
            .unwrap_err()
            .to_string();
        assert!(e.contains("holds no PEM CERTIFICATE"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
