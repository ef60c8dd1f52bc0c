//! [`KafkaPublisher`]: the outbox relay's way to Kafka.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use txinbox::async_trait;
use txinbox::outbox::{CloudEventsBinding, OutboxMessage, PublishError, Publisher, DEFAULT_SOURCE};

use crate::config::{masked_error, Properties};
use crate::connection::ConnectionContext;
use crate::produce;

/// The publisher's producer: its context keeps the last connection problem (TLS, SASL) for the
/// errors [`publish`](Publisher::publish) and [`probe`](Publisher::probe) return.
struct Producer {
    inner: FutureProducer<ConnectionContext>,
    connection: ConnectionContext,
}

fn create(config: &rdkafka::ClientConfig) -> Result<Producer, KafkaError> {
    let mut config = config.clone();
    let connection = ConnectionContext::new(&mut config);
    Ok(Producer {
        inner: config.create_with_context(connection.clone())?,
        connection,
    })
}

/// `text`, followed by the producer's connection problem (a refused TLS handshake, failed SASL
/// authentication) if it has one: the reason a delivery timed out, in words a user can act on.
fn with_problem(text: String, producer: &Producer) -> String {
    match producer.connection.problem() {
        Some(problem) => format!("{text}; the brokers cannot be used: {problem}"),
        None => text,
    }
}

/// Default for [`KafkaPublisher::delivery_timeout`].
pub const DEFAULT_DELIVERY_TIMEOUT: Duration = Duration::from_secs(15);

/// Properties the publisher owns; a pass-through value for them is refused.
const OWNED: &[(&str, &str)] = &[
    ("bootstrap.servers", "pass the brokers to KafkaPublisher::new"),
    (
        "enable.idempotence",
        "the outbox relay needs an idempotent producer so retries inside librdkafka neither duplicate nor reorder a key",
    ),
    ("acks", "a message counts as published only once all in-sync replicas have it (acks=all)"),
    ("message.timeout.ms", "use KafkaPublisher::delivery_timeout"),
    (
        "transactional.id",
        "the relay publishes outside Kafka transactions (a transactional producer would refuse every message); the outbox row is the transaction",
    ),
];

/// Publishes outbox rows to Kafka for a [`txinbox::outbox::Relay`]: the row's destination is
/// the topic, its key the record key (so the partitioner keeps one key on one partition, and
/// the relay's per-key order is the partition's order), its message ID the record headers
/// [`ID_HEADER`](txinbox::outbox::ID_HEADER) and `ce_id`, with the CloudEvents attributes
/// `ce_specversion`, `ce_source` ([`source`](KafkaPublisherBuilder::source)) and `ce_type`
/// unless the row sets them (the row's own headers follow; see
/// [`OutboxMessage::broker_headers`]). A [`KafkaSource`](crate::KafkaSource) with its default
/// settings (CloudEvents IDs) deduplicates on it.
///
/// The producer is idempotent with `acks=all`; [`publish`](Publisher::publish) returns `Ok`
/// only on a successful delivery report. Errors that no retry fixes (record too large, invalid
/// record, topic authorization) are permanent: the relay dead-letters the row. Everything else
/// (broker down, unknown topic, timeout) is transient.
///
/// When librdkafka declares the idempotent producer fatally failed (it can no longer vouch for
/// order and once-ness, e.g. after a sequence desynchronization with the broker; every later
/// message would be refused), the publish fails transiently and the publisher replaces the
/// producer with a new one (a new producer ID): the relay's retry of that row goes through it.
/// Copies the old producer may have delivered are duplicates the downstream inbox drops.
///
/// Dropping the publisher flushes and joins librdkafka's threads: drop it off the async
/// runtime (or after the relay stopped). Unconfirmed messages are no loss: their rows stay
/// pending. A replaced producer is dropped on a thread of its own once its last publish ended.
pub struct KafkaPublisher {
    config: rdkafka::ClientConfig,
    source: String,
    producer: Mutex<Arc<Producer>>,
    delivery_timeout: Duration,
    /// The topic of the last publish: what [`probe`](Publisher::probe) asks about.
    last_topic: Mutex<Option<String>>,
}

impl fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("source", &self.source)
            .field("delivery_timeout", &self.delivery_timeout)
            .finish_non_exhaustive()
    }
}

/// Builds a [`KafkaPublisher`]. Its `Debug` output masks secret property values
/// ([`txinbox::redact`]).
#[derive(Clone)]
pub struct KafkaPublisherBuilder {
    brokers: String,
    source: String,
    delivery_timeout: Duration,
    properties: BTreeMap<String, String>,
}

impl fmt::Debug for KafkaPublisherBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaPublisherBuilder")
            .field("brokers", &txinbox::redact::url(&self.brokers))
            .field("source", &self.source)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("properties", &Properties(&self.properties))
            .finish()
    }
}

impl KafkaPublisher {
    /// A publisher to `brokers` (`host:port[,host:port]`).
    pub fn builder(brokers: impl Into<String>) -> KafkaPublisherBuilder {
        KafkaPublisherBuilder {
            brokers: brokers.into(),
            source: DEFAULT_SOURCE.into(),
            delivery_timeout: DEFAULT_DELIVERY_TIMEOUT,
            properties: BTreeMap::new(),
        }
    }

    /// The longest wait for one delivery report (`message.timeout.ms`).
    pub fn delivery_timeout(&self) -> Duration {
        self.delivery_timeout
    }

    fn current(&self) -> Arc<Producer> {
        Arc::clone(&self.producer.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Replaces `failed` (unless a concurrent publish did already) after a fatal error.
    fn replace(&self, failed: &Arc<Producer>, code: RDKafkaErrorCode, reason: &str) {
        let mut current = self.producer.lock().unwrap_or_else(|p| p.into_inner());
        if !Arc::ptr_eq(&current, failed) {
            return;
        }
        let fresh = match create(&self.config) {
            Ok(p) => p,
            Err(e) => {
                let error = masked_error(&e, &self.config);
                tracing::error!(%error, "the Kafka producer failed fatally and a new one could not be created; retrying on the next publish");
                return;
            }
        };
        tracing::warn!(error = ?code, reason, "the Kafka producer failed fatally; publishing through a new producer");
        let old = std::mem::replace(&mut *current, Arc::new(fresh));
        drop(current);
        // Dropping a producer joins librdkafka's threads: not on the async runtime, and only
        // once the publishes still using it (bounded by delivery_timeout) have let go.
        std::thread::spawn(move || {
            while Arc::strong_count(&old) > 1 {
                std::thread::sleep(Duration::from_millis(100));
            }
            drop(old);
        });
    }
}

impl KafkaPublisherBuilder {
    /// Longest wait for a delivery report (`message.timeout.ms`, including librdkafka's own
    /// retries). Default 15 s; keep it below the relay's `publish_timeout` (default 20 s).
    pub fn delivery_timeout(mut self, d: Duration) -> Self {
        self.delivery_timeout = d;
        self
    }

    /// The CloudEvents `source` (`ce_source`) of rows that do not set their own: a URI
    /// reference naming the service whose outbox this is, e.g. `/billing` or
    /// `urn:example:billing`. Default [`DEFAULT_SOURCE`].
    pub fn source(mut self, source: impl Into<String>) -> Self {
        self.source = source.into();
        self
    }

    /// Sets a librdkafka producer property (security, `linger.ms`, `compression.type`, …).
    /// `enable.idempotence`, `acks`, `message.timeout.ms`, `transactional.id` and
    /// `bootstrap.servers` are owned by the publisher and refused.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(key.into(), value.into());
        self
    }

    /// Validates the settings and creates the producer (it connects in the background).
    pub fn build(self) -> Result<KafkaPublisher, crate::KafkaError> {
        if self.brokers.trim().is_empty() {
            return Err(crate::KafkaError::Config(
                "KafkaPublisher: brokers is empty; pass host:port of at least one broker".into(),
            ));
        }
        if self.source.trim().is_empty() {
            return Err(crate::KafkaError::Config(
                "KafkaPublisher: source is empty; CloudEvents needs a non-empty URI reference such as /billing (or leave the default)".into(),
            ));
        }
        if self.delivery_timeout < Duration::from_millis(1) {
            return Err(crate::KafkaError::Config(
                "KafkaPublisher: delivery_timeout must be at least 1 ms".into(),
            ));
        }
        for (key, why) in OWNED {
            if let Some(v) = self.properties.get(*key) {
                return Err(crate::KafkaError::Config(format!(
                    "KafkaPublisher: property {key}={} cannot be set: {why}",
                    txinbox::redact::property(key, v)
                )));
            }
        }
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "2")
            .set(
                "message.timeout.ms",
                self.delivery_timeout.as_millis().to_string(),
            );
        for (k, v) in &self.properties {
            c.set(k, v);
        }
        let producer = create(&c).map_err(|e| crate::KafkaError::Client {
            context: "creating the outbox producer".into(),
            fatal: true,
            source: masked_error(&e, &c).into(),
        })?;
        Ok(KafkaPublisher {
            config: c,
            source: self.source,
            producer: Mutex::new(Arc::new(producer)),
            delivery_timeout: self.delivery_timeout,
            last_topic: Mutex::new(None),
        })
    }
}

fn classify(e: KafkaError, message: &OutboxMessage, producer: &Producer) -> PublishError {
    let text = with_problem(
        format!(
            "publishing {} to Kafka topic {} failed: {e}",
            message.message_id(),
            message.destination()
        ),
        producer,
    );
    if produce::classify(&e).is_permanent() {
        PublishError::permanent(text)
    } else {
        PublishError::transient(text)
    }
}

#[async_trait]
impl Publisher for KafkaPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        let published = message.broker_headers(CloudEventsBinding::Kafka, &self.source);
        let mut headers = OwnedHeaders::new_with_capacity(published.len());
        for (name, value) in published.iter() {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        let mut record = FutureRecord::to(message.destination())
            .payload(message.payload().as_ref())
            .headers(headers);
        if let Some(key) = message.key() {
            record = record.key(key.as_ref());
        }
        {
            let mut last = self.last_topic.lock().unwrap_or_else(|p| p.into_inner());
            if last.as_deref() != Some(message.destination()) {
                *last = Some(message.destination().to_owned());
            }
        }
        // Waits while the local queue is full, then for the delivery report; bounded by
        // message.timeout.ms (and the relay's own publish_timeout).
        let producer = self.current();
        match producer.inner.send(record, self.delivery_timeout).await {
            Ok(_) => {
                producer.connection.clear();
                Ok(())
            }
            Err((e, _)) => {
                if let Some((code, reason)) = producer.inner.client().fatal_error() {
                    self.replace(&producer, code, &reason);
                    return Err(PublishError::transient(format!(
                        "publishing {} to Kafka topic {}: the producer failed fatally ({reason}); retried through a new producer",
                        message.message_id(),
                        message.destination()
                    )));
                }
                Err(classify(e, message, &producer))
            }
        }
    }

    /// A metadata request for the topic last published to (all topics before the first
    /// publish), bounded by the delivery timeout (at most 10 s): `Ok` when a broker answers and
    /// every partition of that topic has a leader.
    async fn probe(&self) -> Option<Result<(), PublishError>> {
        let producer = self.current();
        let topic = self.last_topic.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let timeout = self.delivery_timeout.min(Duration::from_secs(10));
        // A blocking request: off the runtime's workers.
        let answer = tokio::task::spawn_blocking(move || {
            let metadata = producer
                .inner
                .client()
                .fetch_metadata(topic.as_deref(), timeout)
                .map_err(|e| with_problem(format!("no metadata from the brokers: {e}"), &producer))?;
            let Some(topic) = topic else { return Ok(()) };
            let t = metadata
                .topics()
                .iter()
                .find(|t| t.name() == topic)
                .ok_or_else(|| format!("the brokers' metadata does not mention topic {topic}"))?;
            if let Some(e) = t.error() {
                return Err(format!("topic {topic}: {:?}", RDKafkaErrorCode::from(e)));
            }
            match t
                .partitions()
                .iter()
                .find(|p| p.leader() < 0 || p.error().is_some())
            {
                Some(p) => Err(format!("topic {topic} partition {} has no leader", p.id())),
                None => Ok(()),
            }
        })
        .await;
        Some(match answer {
            Ok(Ok(())) => Ok(()),
            Ok(Err(why)) => Err(PublishError::transient(why)),
            Err(e) => Err(PublishError::transient(format!(
                "the metadata request failed: {e}"
            ))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_properties_are_refused_with_a_reason() {
        for (k, v) in [
            ("acks", "1"),
            ("enable.idempotence", "false"),
            ("message.timeout.ms", "5"),
            ("transactional.id", "relay-1"),
        ] {
            let err = KafkaPublisher::builder("127.0.0.1:9092")
                .set(k, v)
                .build()
                .unwrap_err()
                .to_string();
            assert!(err.contains(k), "{err}");
        }
        let err = KafkaPublisher::builder(" ").build().unwrap_err().to_string();
        assert!(err.contains("brokers"), "{err}");
        let err = KafkaPublisher::builder("127.0.0.1:9092")
            .source(" ")
            .build()
            .unwrap_err()
            .to_string();
        assert!(err.contains("source"), "{err}");
    }

    #[test]
    fn too_large_is_permanent_and_broker_trouble_transient() {
        let m = OutboxMessage::new("id", "t", "p");
        let p = create(rdkafka::ClientConfig::new().set("bootstrap.servers", "127.0.0.1:1")).unwrap();
        let produce = |c| KafkaError::MessageProduction(c);
        assert!(classify(produce(RDKafkaErrorCode::MessageSizeTooLarge), &m, &p).is_permanent());
        assert!(!classify(produce(RDKafkaErrorCode::MessageTimedOut), &m, &p).is_permanent());
        assert!(!classify(produce(RDKafkaErrorCode::UnknownTopicOrPartition), &m, &p).is_permanent());
    }
}
