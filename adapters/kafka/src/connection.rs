//! Connection failures a user must fix (a refused TLS handshake, failed SASL authentication, a
//! plaintext client at a TLS listener), told apart from the broker trouble librdkafka rides out
//! by itself, in one place: [`diagnose`]. The consumer, the dead-letter producer, the outbox
//! publisher and the `txinbox` CLI all read librdkafka through a [`ConnectionContext`].
//!
//! librdkafka never gives up on such a failure: it reconnects with backoff for as long as the
//! client lives, and says why only in its log. Without this, a wrong CA looks like a consumer
//! that silently receives nothing.

use std::sync::{Arc, Mutex};

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::ConsumerContext;
use rdkafka::error::KafkaError;
use rdkafka::ClientContext;

/// A librdkafka client context that reads its errors and connection log lines through
/// one classification (a refused TLS handshake, a refused SASL login, plaintext at a TLS
/// listener) and keeps the last problem found, for an error message or a health report
/// ([`problem`](Self::problem)). Each new problem is logged once at ERROR; librdkafka's own log
/// lines are passed on to `tracing` (target `librdkafka`), as rdkafka's default context does.
///
/// ```no_run
/// use txinbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
/// use txinbox_kafka::rdkafka::ClientConfig;
/// use txinbox_kafka::ConnectionContext;
///
/// let mut config = ClientConfig::new();
/// config.set("bootstrap.servers", "127.0.0.1:9094").set("security.protocol", "SSL");
/// let context = ConnectionContext::new(&mut config);
/// let client: BaseConsumer<ConnectionContext> = config.create_with_context(context).unwrap();
/// if let Err(e) = client.fetch_metadata(None, std::time::Duration::from_millis(10)) {
///     // e.g. "… the broker's certificate was not accepted: set ssl.ca.location …"
///     let why = client.context().problem().unwrap_or_else(|| e.to_string());
///     # let _ = why;
/// }
/// ```
///
/// Clones share the problem: keep one to read it while the client owns the other (rdkafka's
/// `FutureProducer` does not hand its context back).
#[derive(Debug, Clone)]
pub struct ConnectionContext {
    tls: bool,
    problem: Arc<Mutex<Option<String>>>,
}

impl ConnectionContext {
    /// A context for a client made from `config` (its `security.protocol` decides whether a
    /// broker that hangs up at the first request is reported as one expecting TLS).
    ///
    /// Raises `config`'s log level to info (debug when `debug` is set): librdkafka reports a
    /// broker hanging up on a plaintext client only at info, and rdkafka's own level follows
    /// the `log` crate, which is off where `tracing` is used alone. The lines are passed on to
    /// `tracing`, whose filter decides what is shown.
    pub fn new(config: &mut rdkafka::ClientConfig) -> ConnectionContext {
        config.set_log_level(if config.get("debug").is_some() {
            RDKafkaLogLevel::Debug
        } else {
            RDKafkaLogLevel::Info
        });
        let tls = config
            .get("security.protocol")
            .is_some_and(|p| p.to_ascii_lowercase().ends_with("ssl"));
        ConnectionContext {
            tls,
            problem: Arc::new(Mutex::new(None)),
        }
    }

    /// The last connection problem a user must fix, with librdkafka's words and what to change;
    /// `None` when there was none since the client started or since [`clear`](Self::clear).
    pub fn problem(&self) -> Option<String> {
        self.lock().clone()
    }

    /// Forgets the last problem (a broker answered since).
    pub fn clear(&self) {
        *self.lock() = None;
    }

    /// Reads one librdkafka error or connection log line; returns the problem when it is a new
    /// one (logged once at ERROR).
    pub(crate) fn observe(&self, text: &str) -> Option<String> {
        let problem = diagnose(text, self.tls)?;
        let mut last = self.lock();
        if last.as_deref() == Some(problem.as_str()) {
            return None;
        }
        tracing::error!(%problem, "cannot use the Kafka brokers; librdkafka keeps retrying");
        *last = Some(problem.clone());
        Some(problem)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.problem.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ClientContext for ConnectionContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        forward_log(level, fac, log_message);
        if fac == "FAIL" {
            self.observe(log_message);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if self.observe(reason).is_none() {
            tracing::warn!(target: "librdkafka", %error, reason, "librdkafka error");
        }
    }
}

impl ConsumerContext for ConnectionContext {}

/// librdkafka's log line on `tracing`, at its level (what rdkafka's default context does on
/// `log`).
pub(crate) fn forward_log(level: RDKafkaLogLevel, fac: &str, message: &str) {
    match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => tracing::error!(target: "librdkafka", "librdkafka: {fac} {message}"),
        RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", "librdkafka: {fac} {message}"),
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
            tracing::info!(target: "librdkafka", "librdkafka: {fac} {message}")
        }
        RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", "librdkafka: {fac} {message}"),
    }
}

/// The connection problem a user must fix that librdkafka's error or log line `text` reports,
/// as what to change followed by librdkafka's words (without its "(after … in state …)"
/// suffix, so that one problem reads the same on every retry); `None` for everything
/// librdkafka recovers from by itself (a broker down, a refused or reset TCP connection). `tls`:
/// the client's `security.protocol` is `SSL` or `SASL_SSL`.
pub(crate) fn diagnose(text: &str, tls: bool) -> Option<String> {
    let hint = if text.contains("certificate verify failed") {
        "the broker's TLS certificate was not accepted: set ssl.ca.location to the CA that signed it \
         (unset: the system's CA certificates, from the ca-certificates package), and name the \
         brokers in bootstrap.servers as their certificate does (librdkafka checks the host name, \
         ssl.endpoint.identification.algorithm=https)"
    } else if text.contains("certificate required")
        || text.contains("alert bad certificate")
        || text.contains("alert unknown ca")
    {
        "the broker requires a client certificate it trusts: set ssl.certificate.location and \
         ssl.key.location (and ssl.key.password for an encrypted key)"
    } else if text.contains("wrong version number") || text.contains("packet length too long") {
        "the broker does not speak TLS on this port: use its TLS listener, or \
         security.protocol=PLAINTEXT (SASL_PLAINTEXT with SASL) if it has none"
    } else if text.contains("SSL handshake failed") {
        "the TLS handshake with the broker failed: check ssl.ca.location, the client certificate \
         settings and that the port is the broker's TLS listener"
    } else if text.contains("SASL") && (text.contains("failed") || text.contains("error")) {
        "SASL authentication failed: check security.protocol (SASL_SSL), sasl.mechanisms and the \
         credentials (sasl.username and sasl.password, or the OAUTHBEARER settings)"
    } else if !tls && text.contains("Disconnected") && text.contains("APIVERSION_QUERY") {
        "the broker hung up at the first request: it probably expects TLS; set \
         security.protocol=SSL (SASL_SSL with SASL) and, for a private CA, ssl.ca.location"
    } else {
        return None;
    };
    let said = text.rfind(" (after ").map_or(text, |at| &text[..at]).trim();
    Some(format!("{hint} (librdkafka: {said})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// librdkafka's words, as it logged them against the listeners of `ensure_tansu_tls`.
    #[test]
    fn each_refusal_names_what_to_change_and_keeps_librdkafkas_words() {
        let cases = [
            (
                "ssl://127.0.0.1:9094/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified, verify that ssl.ca.location is correctly configured or root CA certificates are installed (install ca-certificates package) (after 28ms in state SSL_HANDSHAKE)",
                true,
                "set ssl.ca.location",
            ),
            (
                "ssl://127.0.0.1:9096/bootstrap: Receive failed: error:0A00045C:SSL routines::tlsv13 alert certificate required: SSL alert number 116 (after 0ms in state APIVERSION_QUERY)",
                true,
                "ssl.certificate.location",
            ),
            (
                "sasl_ssl://127.0.0.1:9098/bootstrap: SASL authentication error: SASL SCRAM authentication failed: broker responded with unknown-user (after 29ms in state AUTH_REQ)",
                true,
                "sasl.username",
            ),
            (
                "127.0.0.1:9094/bootstrap: Disconnected: connection reset by peer (after 0ms in state APIVERSION_QUERY)",
                false,
                "security.protocol=SSL",
            ),
            (
                "ssl://127.0.0.1:9092/bootstrap: SSL handshake failed: error:0A00010B:SSL routines::wrong version number (after 1ms in state SSL_HANDSHAKE)",
                true,
                "does not speak TLS",
            ),
        ];
        for (text, tls, hint) in cases {
            let problem = diagnose(text, tls).unwrap_or_else(|| panic!("no problem in {text}"));
            assert!(problem.contains(hint), "{problem}");
            assert!(problem.contains("librdkafka: "), "{problem}");
            assert!(
                !problem.contains("(after "),
                "the retry-specific suffix is cut: {problem}"
            );
        }
    }

    #[test]
    fn what_librdkafka_rides_out_is_no_problem() {
        for (text, tls) in [
            ("127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused (after 0ms in state CONNECT)", false),
            ("127.0.0.1:9092/1: Disconnected (after 60012ms in state UP)", false),
            // A TLS client whose broker hangs up at the first request: not "expects TLS".
            ("ssl://127.0.0.1:9094/bootstrap: Disconnected: connection reset by peer (after 0ms in state APIVERSION_QUERY)", true),
        ] {
            assert_eq!(diagnose(text, tls), None, "{text}");
        }
    }

    #[test]
    fn one_problem_is_logged_once_whatever_its_retry_suffix() {
        let mut config = rdkafka::ClientConfig::new();
        config.set("security.protocol", "SASL_SSL");
        let context = ConnectionContext::new(&mut config);
        let line = |ms: u32| {
            format!(
                "sasl_ssl://h:1/bootstrap: SASL authentication error: bad (after {ms}ms in state AUTH_REQ)"
            )
        };
        assert!(context.observe(&line(3)).is_some());
        assert!(context.observe(&line(9)).is_none(), "the same problem again");
        assert!(context.problem().unwrap().contains("SASL authentication failed"));
        context.clear();
        assert_eq!(context.problem(), None);
    }
}
