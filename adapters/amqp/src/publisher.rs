//! [`AmqpPublisher`]: the outbox relay's way to RabbitMQ.

use std::fmt;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, ByteArray, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use crate::tls::AmqpTls;
use txinbox::async_trait;
use txinbox::outbox::{CloudEventsBinding, OutboxMessage, PublishError, Publisher, DEFAULT_SOURCE};

use crate::confirm::confirmed;
use crate::error::AmqpError;
use crate::fit;
use crate::headers::KEY as KEY_HEADER;

/// Default for [`AmqpPublisher::channels`].
pub const DEFAULT_CHANNELS: usize = 4;

/// Default for [`AmqpPublisher::publish_timeout`].
pub const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// Publishes outbox rows to RabbitMQ for a [`txinbox::outbox::Relay`]: to the configured
/// exchange (default: the default exchange `""`, so the destination is a queue name), with
/// the row's destination as routing key, persistent, `mandatory`, and with publisher confirms.
///
/// [`publish`](Publisher::publish) returns `Ok` only for a positive confirm of a routed
/// message: a message the broker returns as unroutable (no queue bound), a negative confirm, a
/// lost connection or no confirm within [`publish_timeout`](Self::publish_timeout) is an
/// error (transient: the relay retries it with backoff and dead-letters it after its bounded
/// attempts). A message no retry can deliver is a permanent error (the relay dead-letters the
/// row at once): headers too large for a content-header frame of the connection's `frame_max`
/// (checked before sending: the broker would close the connection), or a body the broker
/// refuses as over its `max_message_size`.
///
/// The message carries its ID as the `message_id` property (the AMQP source's default
/// [`IdStrategy::Native`](txinbox::IdStrategy::Native)), as header
/// [`ID_HEADER`](txinbox::outbox::ID_HEADER) and as the CloudEvents `cloudEvents:id`, with
/// `cloudEvents:specversion`, `cloudEvents:source` ([`source`](Self::source)) and
/// `cloudEvents:type` unless the row sets them ([`OutboxMessage::broker_headers`]); its key,
/// if any, as header [`headers::KEY`](crate::headers::KEY); then the row's own headers (UTF-8
/// values as long strings, others as byte arrays).
///
/// Each channel carries one publish at a time: lapin pairs a `basic.return` with whichever
/// confirm completes next, so with several publishes in flight on a channel an unroutable
/// message could be taken as confirmed. For throughput the publisher keeps
/// [`channels`](Self::channels) connections (default 4), each with one channel, used by
/// concurrent publishes of different keys. Per-key order holds regardless: the relay publishes
/// a key's next row only after the previous one was confirmed, i.e. is in its queue. After any
/// failure that connection is dropped and the next publish on it opens a new one — and so is
/// the connection of a publish whose future is dropped before its confirm arrived
/// (cancellation-safe: that message counts as not confirmed, and its late confirm or return
/// cannot be taken for another message's).
pub struct AmqpPublisher {
    uri: String,
    tls: AmqpTls,
    exchange: ShortString,
    source: String,
    publish_timeout: Duration,
    connect_timeout: Duration,
    lanes: Vec<tokio::sync::Mutex<Option<Session>>>,
    next_lane: std::sync::atomic::AtomicUsize,
}

struct Session {
    conn: Connection,
    channel: Channel,
}

impl fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("uri", &txinbox::redact::url(&self.uri))
            .field("tls", &self.tls)
            .field("exchange", &self.exchange)
            .field("source", &self.source)
            .field("publish_timeout", &self.publish_timeout)
            .finish_non_exhaustive()
    }
}

impl AmqpPublisher {
    /// Connects to `uri` (`amqp://user:pass@host:port/vhost`) and enables publisher confirms.
    /// The first connection must succeed, so bad credentials show up at startup; later losses
    /// are repaired on the next publish. Publishes go to the default exchange until
    /// [`exchange`](Self::exchange) says otherwise.
    pub async fn connect(uri: impl Into<String>) -> Result<AmqpPublisher, AmqpError> {
        AmqpPublisher::connect_with_tls(uri, AmqpTls::default()).await
    }

    /// [`connect`](Self::connect) with the CA and client certificate of an `amqps://`
    /// connection (see [`AmqpTls`]); every connection the publisher opens uses them.
    pub async fn connect_with_tls(uri: impl Into<String>, tls: AmqpTls) -> Result<AmqpPublisher, AmqpError> {
        let uri = uri.into();
        tls.check(&uri, "AmqpPublisher uri")?;
        let publisher = AmqpPublisher {
            uri,
            tls,
            exchange: ShortString::default(),
            source: DEFAULT_SOURCE.into(),
            publish_timeout: DEFAULT_CONFIRM_TIMEOUT,
            connect_timeout: crate::DEFAULT_CONNECT_TIMEOUT,
            lanes: Vec::new(),
            next_lane: Default::default(),
        }
        .channels(DEFAULT_CHANNELS);
        let session = publisher.open().await?;
        *publisher.lanes[0].lock().await = Some(session);
        Ok(publisher)
    }

    /// How many publishes (of different keys) may wait for their confirms at once: one
    /// connection and channel each, opened when first needed. Default 4; at least 1.
    pub fn channels(mut self, n: usize) -> Self {
        let mut lanes = std::mem::take(&mut self.lanes);
        lanes.resize_with(n.max(1), || tokio::sync::Mutex::new(None));
        self.lanes = lanes;
        self
    }

    /// Publishes to `exchange` (which must exist), with the row's destination as routing key.
    pub fn exchange(mut self, exchange: impl Into<String>) -> Self {
        self.exchange = ShortString::from(exchange.into());
        self
    }

    /// The CloudEvents `source` (`cloudEvents:source`) of rows that do not set their own: a URI
    /// reference naming the service whose outbox this is, e.g. `/billing`. Default
    /// [`DEFAULT_SOURCE`] (also used if `source` is empty).
    pub fn source(mut self, source: impl Into<String>) -> Self {
        self.source = source.into();
        self
    }

    /// Longest wait for a publish and its confirm. Default 10 s; keep it below the relay's
    /// `publish_timeout` (default 20 s).
    pub fn publish_timeout(mut self, d: Duration) -> Self {
        self.publish_timeout = d;
        self
    }

    async fn open(&self) -> Result<Session, AmqpError> {
        let broker = |context: &str, e: Box<dyn std::error::Error + Send + Sync>| AmqpError::Broker {
            context: context.into(),
            fatal: false,
            source: e,
        };
        let props = ConnectionProperties::default()
            .with_connection_name(format!("txinbox-outbox-{}", std::process::id()).into());
        let setup = async {
            let conn = self.tls.connect(&self.uri, props).await?;
            let channel = conn
                .create_channel()
                .await
                .map_err(|e| broker("channel.open", e.into()))?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(|e| broker("confirm.select", e.into()))?;
            Ok::<_, AmqpError>(Session { conn, channel })
        };
        match tokio::time::timeout(self.connect_timeout, setup).await {
            Ok(r) => r,
            Err(_) => Err(broker(
                "connect",
                format!(
                    "no connection to {} within {:?}",
                    txinbox::redact::url(&self.uri),
                    self.connect_timeout
                )
                .into(),
            )),
        }
    }

    fn properties(&self, message: &OutboxMessage) -> BasicProperties {
        let mut headers = FieldTable::default();
        if let Some(key) = message.key() {
            headers.insert(KEY_HEADER.into(), value(key));
        }
        for (name, v) in message
            .broker_headers(CloudEventsBinding::Amqp, &self.source)
            .iter()
        {
            if name != KEY_HEADER {
                headers.insert(name.into(), value(v));
            }
        }
        BasicProperties::default()
            .with_message_id(message.message_id().into())
            .with_delivery_mode(2)
            .with_headers(headers)
    }
}

/// A lane held by one publish. Dropped before the publish got its verdict (the relay cancelled
/// it), it discards the lane's connection: the confirm (or return) still in flight could
/// otherwise be paired with the next publish on that channel — an unroutable message taken as
/// confirmed.
struct Lane<'a> {
    session: tokio::sync::MutexGuard<'a, Option<Session>>,
    settled: bool,
}

impl Drop for Lane<'_> {
    fn drop(&mut self) {
        if !self.settled {
            // Dropping the last handle closes the connection.
            self.session.take();
        }
    }
}

fn value(bytes: &[u8]) -> AMQPValue {
    match std::str::from_utf8(bytes) {
        Ok(s) => AMQPValue::LongString(LongString::from(s)),
        Err(_) => AMQPValue::ByteArray(ByteArray::from(bytes.to_vec())),
    }
}

#[async_trait]
impl Publisher for AmqpPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        let what = || {
            format!(
                "{} to exchange {:?} routing key {}",
                message.message_id(),
                self.exchange.as_str(),
                message.destination()
            )
        };
        // One publish per channel at a time (see the type's docs): a free lane, else wait for one.
        let start = self.next_lane.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let n = self.lanes.len();
        let free = (0..n).find_map(|i| self.lanes[(start + i) % n].try_lock().ok());
        let mut lane = Lane {
            session: match free {
                Some(guard) => guard,
                None => self.lanes[start % n].lock().await,
            },
            settled: false,
        };
        let session = &mut *lane.session;
        if session.as_ref().is_none_or(|s| !s.channel.status().connected()) {
            *session = None;
            let fresh = self
                .open()
                .await
                .map_err(|e| PublishError::transient(format!("publishing {}: {e}", what())))?;
            *session = Some(fresh);
        }
        let (channel, frame_max) = session
            .as_ref()
            .map(|s| (s.channel.clone(), s.conn.configuration().frame_max()))
            .expect("session set above");
        let properties = self.properties(message);
        if let Err(why) = fit::check(&properties, frame_max) {
            // Nothing was sent: the lane's channel is as good as before.
            lane.settled = true;
            return Err(PublishError::permanent(format!(
                "publishing {}: {why}; the broker would close the connection (FRAME_ERROR) on every attempt, so the row is dead-lettered (smaller headers would fit)",
                what()
            )));
        }
        let publish = async {
            let confirm = channel
                .basic_publish(
                    self.exchange.clone(),
                    message.destination().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    message.payload(),
                    properties,
                )
                .await?;
            confirm.await
        };
        let verdict = confirmed(self.publish_timeout, publish).await;
        lane.settled = true;
        let session = &mut *lane.session;
        let (failure, too_large) = match verdict {
            Ok(()) => return Ok(()),
            Err(unconfirmed) => (
                unconfirmed.detail(|code, text| {
                    format!("returned as unroutable ({code} {text}); is a queue bound for this routing key?")
                }),
                fit::is_size_refusal(&unconfirmed),
            ),
        };
        // The channel's state is uncertain now (a late confirm or return could be paired with
        // the next publish): start over with a fresh connection.
        if let Some(old) = session.take() {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                old.conn.close(200, "publish failed".into()),
            )
            .await;
        }
        let text = format!("publishing {}: {failure}", what());
        if too_large {
            // The broker's max_message_size: the same row is refused on every attempt.
            return Err(PublishError::permanent(text));
        }
        Err(PublishError::transient(text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use txinbox::message::Headers;
    use txinbox::outbox::ID_HEADER;

    #[test]
    fn id_and_key_travel_as_property_and_headers() {
        let m = OutboxMessage::new("id-1", "q", "p")
            .with_key("k")
            .with_headers(Headers::new().with("raw", &b"\xff"[..]).with(ID_HEADER, "forged"));
        let publisher = AmqpPublisher {
            uri: String::new(),
            tls: AmqpTls::default(),
            exchange: ShortString::default(),
            source: "/billing".into(),
            publish_timeout: DEFAULT_CONFIRM_TIMEOUT,
            connect_timeout: crate::DEFAULT_CONNECT_TIMEOUT,
            lanes: Vec::new(),
            next_lane: Default::default(),
        };
        let p = publisher.properties(&m);
        assert_eq!(p.message_id().as_ref().map(|s| s.as_str()), Some("id-1"));
        assert_eq!(p.delivery_mode(), &Some(2));
        let headers = crate::headers::to_headers(p.headers().as_ref());
        assert_eq!(headers.get_str(ID_HEADER), Some("id-1"), "the row's ID wins");
        assert_eq!(headers.get_str(KEY_HEADER), Some("k"));
        assert_eq!(headers.get("raw"), Some(&b"\xff"[..]));
        assert_eq!(headers.get_str("cloudEvents:id"), Some("id-1"));
        assert_eq!(headers.get_str("cloudEvents:specversion"), Some("1.0"));
        assert_eq!(headers.get_str("cloudEvents:source"), Some("/billing"));
        assert_eq!(
            headers.get_str("cloudEvents:type"),
            Some("q"),
            "the destination by default"
        );
    }

    /// A publish the relay cancels (its own `publish_timeout`, shutdown) while the confirm is
    /// in flight must not leave that channel to the next publish. Needs RabbitMQ (`AMQP_URL`).
    #[tokio::test]
    async fn a_cancelled_publish_leaves_no_confirm_in_flight_for_the_next() {
        let uri =
            std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let publisher = AmqpPublisher::connect(uri)
            .await
            .expect("connect to AMQP_URL (is RabbitMQ running?)")
            .channels(1);
        assert!(publisher.lanes[0].try_lock().unwrap().is_some());
        let message = OutboxMessage::new("cancelled", "txinbox-no-such-queue", "p");
        // One poll: the publish is on the wire (or about to be), its confirm cannot be back yet.
        let publish = publisher.publish(&message);
        assert!(futures::poll!(publish).is_pending());
        assert!(
            publisher.lanes[0].try_lock().unwrap().is_none(),
            "the cancelled publish's connection is discarded"
        );
        publisher
            .publish(&OutboxMessage::new("next", "txinbox-no-such-queue", "p"))
            .await
            .expect_err("a fresh connection still reports the next message as unroutable");
    }
}
