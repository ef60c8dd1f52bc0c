//! Republishing a RabbitMQ dead letter to its original queue (default exchange, publisher
//! confirms, mandatory so a missing queue is an error rather than a silent drop).

use std::time::Duration;

use txinbox_amqp::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use txinbox_amqp::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use txinbox_amqp::lapin::{self, BasicProperties, Channel, Connection, ConnectionProperties};
use txinbox_amqp::{confirmed, Unconfirmed};

use crate::error::CliError;

const TIMEOUT: Duration = Duration::from_secs(10);

/// A confirming channel to the broker at `url`.
pub struct Amqp {
    _connection: Connection,
    channel: Channel,
}

impl Amqp {
    /// Connects; errors name the broker without credentials.
    pub async fn connect(url: &str) -> Result<Amqp, CliError> {
        let unreachable = |detail: String| CliError::Unreachable {
            service: format!("RabbitMQ at {}", without_credentials(url)),
            detail: format!("{detail} (check --amqp-url / AMQP_URL and that the broker runs)"),
        };
        // Parsed here: lapin's parse error quotes the whole URL, password included.
        let uri: lapin::uri::AMQPUri = url.parse().map_err(|_| {
            CliError::BadArgs(
                "--amqp-url / AMQP_URL does not parse; expected amqp://user:pass@host:port/vhost".into(),
            )
        })?;
        let connection = tokio::time::timeout(
            TIMEOUT,
            Connection::connect_uri(uri, ConnectionProperties::default()),
        )
        .await
        .map_err(|_| unreachable(format!("no answer within {TIMEOUT:?}")))?
        .map_err(|e| unreachable(e.to_string()))?;
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
/// requeued copy (RabbitMQ's `x-death`, txinbox's retry counter and dead-letter headers).
pub fn is_bookkeeping(name: &str) -> bool {
    name == "x-death"
        || name.starts_with("x-first-death")
        || name.starts_with("x-last-death")
        || name.starts_with("x-txinbox-")
}
