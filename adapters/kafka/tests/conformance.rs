//! The conformance suites (`txinbox_testing::conformance`) against the Kafka adapter, on
//! librdkafka's mock cluster (no broker needed): `KafkaSource`/`KafkaDelivery` through the
//! source suite, `KafkaPublisher` through the publisher suite. One mock cluster per case.
//!
//! The source is opened without a consumer, so no database position is ever written: it is
//! configured with `MissingPosition::AdoptGroupOffset`, which makes the group's committed
//! offsets (what the source stores after each settlement) the only record, as a reopen needs.

use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::ClientConfig;
use txinbox::{async_trait, message::Headers, message::Origin, store::StoreError, Message};
use txinbox::{position::ConsumerPositions, position::PositionStore, MessageSource as _};
use txinbox_kafka::{KafkaConfig, KafkaPublisher, KafkaSource, MissingPosition};
use txinbox_testing::conformance::{publisher, source};

/// librdkafka's mock cluster on a thread of its own (it is `!Send`); it stops when dropped.
struct Mock {
    bootstrap: String,
    commands: std_mpsc::Sender<(Command, std_mpsc::Sender<()>)>,
}

enum Command {
    /// Create a topic with this many partitions.
    Topic(String, i32),
    /// Make the broker refuse a topic for good (not authorized).
    Refuse(String),
}

impl Mock {
    fn start() -> Mock {
        let (commands, rx) = std_mpsc::channel::<(Command, std_mpsc::Sender<()>)>();
        let (ready, bootstrap) = std_mpsc::channel();
        std::thread::spawn(move || {
            let cluster = MockCluster::new(1).expect("mock cluster");
            ready.send(cluster.bootstrap_servers()).unwrap();
            for (command, done) in rx {
                match command {
                    Command::Topic(name, partitions) => cluster.create_topic(&name, partitions, 1).unwrap(),
                    Command::Refuse(name) => cluster
                        .topic_error(
                            &name,
                            RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
                        )
                        .unwrap(),
                }
                let _ = done.send(());
            }
        });
        Mock {
            bootstrap: bootstrap.recv().unwrap(),
            commands,
        }
    }

    fn call(&self, command: Command) {
        let (done, wait) = std_mpsc::channel();
        self.commands.send((command, done)).unwrap();
        wait.recv().unwrap();
    }

    fn topic(&self, name: &str, partitions: i32) {
        self.call(Command::Topic(name.into(), partitions));
    }
}

/// Every record of `topic` (partitions `0..partitions`) from the beginning, until `n` arrived
/// or `within` passed; in offset order per partition.
fn read_all(brokers: &str, topic: &str, partitions: i32, n: usize, within: Duration) -> Vec<Message> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "conformance-reader")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, rdkafka::Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let started = Instant::now();
    let mut out = Vec::new();
    while out.len() < n && started.elapsed() < within {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            let mut headers = Headers::new();
            if let Some(hs) = m.headers() {
                for h in hs.iter() {
                    headers.insert(h.key, h.value.unwrap_or_default().to_vec());
                }
            }
            let mut message = Message::new(
                m.payload().unwrap_or_default().to_vec(),
                Origin::new("kafka", topic.to_owned()),
            )
            .with_headers(headers);
            if let Some(key) = m.key() {
                message = message.with_key(key.to_vec());
            }
            out.push(message);
        }
    }
    out
}

/// No database: the source reads no positions.
struct NoPositions;

#[async_trait]
impl PositionStore for NoPositions {
    async fn load(&self, _: &str, _: &str) -> Result<Vec<(String, i64)>, StoreError> {
        Ok(Vec::new())
    }
}

// ---------------------------------------------------------------------------------------------
// Source

struct SourceHarness {
    mock: Mock,
    topic: String,
    producer: FutureProducer,
}

async fn source_harness(case: &'static str) -> SourceHarness {
    let mock = Mock::start();
    let topic = format!("conformance-{case}");
    // Two partitions where the case is about lanes; one elsewhere, so "in order" is defined.
    let partitions = if case == "lanes_keep_publish_order" { 2 } else { 1 };
    mock.topic(&topic, partitions);
    mock.topic(&format!("{topic}.dlq"), 1);
    let producer = ClientConfig::new()
        .set("bootstrap.servers", &mock.bootstrap)
        .set("message.timeout.ms", "30000")
        .create()
        .expect("producer");
    SourceHarness {
        mock,
        topic,
        producer,
    }
}

#[async_trait]
impl source::Harness for SourceHarness {
    type Source = KafkaSource;

    fn features(&self) -> source::Features {
        // A dropped record's offset is not stored; the same member does not fetch it again.
        source::Features::default()
            .redelivers_while_open(false)
            .patience(Duration::from_secs(30))
            .quiet(Duration::from_millis(500))
    }

    async fn publish(&self, message: source::TestMessage) {
        let mut headers = OwnedHeaders::new().insert(Header {
            key: "ce_id",
            value: Some(message.id.as_str()),
        });
        for (name, value) in message.headers.iter() {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        let mut record = FutureRecord::<str, str>::to(&self.topic)
            .payload(&message.payload)
            .headers(headers);
        if let Some(key) = &message.key {
            record = record.key(key);
        }
        self.producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .expect("produce a test record");
    }

    async fn open(&self) -> KafkaSource {
        let config = KafkaConfig::new(&self.mock.bootstrap, format!("g-{}", self.topic))
            .topic(&self.topic)
            .on_missing_position(MissingPosition::AdoptGroupOffset)
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .set("auto.commit.interval.ms", "200")
            .revoke_timeout(Duration::from_secs(2))
            .close_timeout(Duration::from_secs(15));
        let mut source = KafkaSource::new(config).expect("kafka source");
        // No consumer here: the suite drives the source itself, so it hands over positions
        // that are always empty (the group's offsets decide, `AdoptGroupOffset`).
        source.attach_positions(ConsumerPositions::new("conformance", NoPositions));
        source
    }

    async fn dead_letters(&self, expected: usize, within: Duration) -> Option<Vec<Message>> {
        let (brokers, topic) = (self.mock.bootstrap.clone(), format!("{}.dlq", self.topic));
        Some(
            tokio::task::spawn_blocking(move || read_all(&brokers, &topic, 1, expected, within))
                .await
                .unwrap(),
        )
    }
}

txinbox_testing::source_conformance!(source_harness);

// ---------------------------------------------------------------------------------------------
// Publisher

mod publishing {
    use super::*;

    pub struct PublisherHarness {
        mock: Mock,
        publisher: KafkaPublisher,
    }

    pub async fn publisher_harness(_case: &'static str) -> PublisherHarness {
        let mock = Mock::start();
        let publisher = KafkaPublisher::builder(&mock.bootstrap)
            .delivery_timeout(Duration::from_secs(10))
            .build()
            .expect("publisher");
        PublisherHarness { mock, publisher }
    }

    #[async_trait]
    impl publisher::Harness for PublisherHarness {
        type Publisher = KafkaPublisher;

        fn publisher(&self) -> &KafkaPublisher {
            &self.publisher
        }

        async fn destination(&self, label: &str) -> String {
            let topic = format!("conformance-{label}");
            self.mock.topic(&topic, 1);
            topic
        }

        async fn read(
            &self,
            destination: &str,
            expected: usize,
            within: Duration,
        ) -> Vec<publisher::Published> {
            let (brokers, topic) = (self.mock.bootstrap.clone(), destination.to_owned());
            tokio::task::spawn_blocking(move || read_all(&brokers, &topic, 1, expected, within))
                .await
                .unwrap()
                .into_iter()
                .map(|m| publisher::Published {
                    payload: m.payload().to_vec(),
                    key: m.key().map(|k| k.to_vec()),
                    headers: m.headers().clone(),
                })
                .collect()
        }

        async fn unroutable(&self) -> Option<String> {
            // The mock cluster creates any topic it is asked for (an illegal name too), so the
            // refusal is injected: this topic is not authorized.
            let topic = "conformance-forbidden".to_owned();
            self.mock.call(Command::Refuse(topic.clone()));
            Some(topic)
        }
    }

    txinbox_testing::publisher_conformance!(publisher_harness);
}
