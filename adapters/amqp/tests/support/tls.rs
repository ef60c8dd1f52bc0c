//! The TLS-only RabbitMQ node and the certificates `scripts/test` makes for it
//! (`ensure_test_certs` in scripts/lib/tls.sh, `ensure_rabbitmq_tls` in scripts/lib/services.sh).

#![allow(dead_code)]

use std::path::PathBuf;

/// `AMQPS_URL`, default `amqps://guest:guest@127.0.0.1:5671/%2f`: the TLS-only node.
pub fn amqps_url() -> String {
    std::env::var("AMQPS_URL").unwrap_or_else(|_| "amqps://guest:guest@127.0.0.1:5671/%2f".into())
}

/// `$TXINBOX_TLS_DIR/<name>` (default `/var/lib/txinbox/tls`): `ca.pem`, `client.pem`,
/// `client.key`, `other-ca.pem`. Panics, saying what to run, when it is missing.
pub fn file(name: &str) -> PathBuf {
    let dir = std::env::var("TXINBOX_TLS_DIR").unwrap_or_else(|_| "/var/lib/txinbox/tls".into());
    let path = PathBuf::from(dir).join(name);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/test's setup (or: source scripts/lib/services.sh scripts/lib/tls.sh; ensure_test_certs; ensure_rabbitmq_tls)",
        path.display()
    );
    path
}
