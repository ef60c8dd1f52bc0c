//! Republishing a RabbitMQ dead letter to its original queue (default exchange, publisher
//! confirms, mandatory so a missing queue is an error rather than a silent drop).

use std::time::Duration;

use txinbox_amqp::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use txinbox_amqp::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use txinbox_amqp::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use txinbox_amqp::{confirmed, AmqpError, AmqpTls, Unconfirmed};

use crate::error::CliError;
use crate::AmqpTlsFiles;

const TIMEOUT: Duration = Duration::from_secs(10);

/// A confirming channel to the broker at `url`.
pub struct Amqp {
    _connection: Connection,
    channel: Channel,
}

impl Amqp {
    /// Connects, over TLS with `tls` for `amqps://`; errors name the broker without
    /// credentials and say what to change.
    pub async fn connect(url: &str, tls: &AmqpTlsFiles) -> Result<Amqp, CliError> {
        let unreachable = |detail: String| CliError::Unreachable {
            service: format!("RabbitMQ at {}", without_credentials(url)),
            detail: format!(
                "{detail} (check --amqp-url / AMQP_URL, the --amqp-* TLS flags and that the broker runs)"
            ),
        };
        let mut settings = AmqpTls::new();
        if let Some(ca) = &tls.amqp_ca_file {
            settings = settings.ca_file(ca);
        }
        if let (Some(cert), Some(key)) = (&tls.amqp_client_cert, &tls.amqp_client_key) {
            settings = settings.client_certificate(cert, key);
        }
        let connection =
            tokio::time::timeout(TIMEOUT, settings.connect(url, ConnectionProperties::default()))
                .await
                .map_err(|_| unreachable(format!("no answer within {TIMEOUT:?}")))?
                .map_err(|e| match e {
                    // Its message names --amqp-url's setting and hides the password.
                    AmqpError::Config(m) => {
                        CliError::BadArgs(format!("--amqp-url / AMQP_URL and the --amqp-* TLS flags: {m}"))
                    }
                    other => unreachable(other.to_string()),
                })?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        Ok(Amqp {
            _connection: connection,
            channel,
        })
    }

    /// Publishes `payload` with `headers` (and `message_id` as the AMQP property, if given) to
    /// `queue` through the default exchange, persistent, and waits for the broker's confirm.
    pub async fn publish(
        &self,
        queue: &str,
        payload: &[u8],
        headers: &[(String, Vec<u8>)],
        message_id: Option<&str>,
    ) -> Result<(), String> {
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert(
                k.as_str().into(),
                AMQPValue::LongString(LongString::from(v.clone())),
            );
        }
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(table);
        if let Some(id) = message_id {
            properties = properties.with_message_id(ShortString::from(id));
        }
        let publish = async {
            self.channel
                .basic_publish(
                    ShortString::default(),
                    ShortString::from(queue),
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    payload,
                    properties,
                )
                .await?
                .await
        };
        confirmed(TIMEOUT, publish)
            .await
            .map_err(|unconfirmed| match unconfirmed {
                Unconfirmed::Returned { .. } => format!("{unconfirmed}: does queue {queue} exist?"),
                other => other.to_string(),
            })
    }
}

/// `amqp://user:pass@host:port/vhost` → `host:port/vhost`.
fn without_credentials(url: &str) -> String {
    // One redaction (passwords, secret query parameters), then the user and scheme left out.
    let shown = txinbox::redact::url(url);
    let rest = shown.split_once("://").map_or(shown.as_str(), |(_, r)| r);
    rest.rsplit_once('@').map_or(rest, |(_, r)| r).to_owned()
}

/// Whether a stored header is broker or txinbox bookkeeping that must not travel with a
/// requeued copy (RabbitMQ's `x-death` and quorum queues' delivery counters, txinbox's retry
/// counter and dead-letter headers).
pub fn is_bookkeeping(name: &str) -> bool {
    name == "x-death"
        || name == txinbox_amqp::headers::DELIVERY_COUNT
        || name == txinbox_amqp::headers::ACQUIRED_COUNT
        || name.starts_with("x-first-death")
        || name.starts_with("x-last-death")
        || name.starts_with("x-txinbox-")
}
