//! The Kafka rows, on topics created for the run and deleted at its end.

use std::time::Duration;

use txinbox::IdStrategy;

use crate::bench::{Bench, Variant};
use crate::peers::kafka_peer;
use crate::publish::{Load, Publisher};
use crate::report::{print_row, Mode, Row};

impl Bench {
    pub(crate) async fn kafka_rows(&self, rows: &mut Vec<Row>) -> anyhow::Result<()> {
        use rdkafka::admin::{AdminClient, AdminOptions};
        use rdkafka::client::DefaultClientContext;
        let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
        if !reachable(&brokers).await {
            let why = format!("no broker at {brokers} (set KAFKA_BROKERS; tansu: source scripts/lib/tansu.sh && ensure_tansu)");
            if self.args.require_brokers {
                anyhow::bail!("kafka: {why}; --require-brokers makes that an error");
            }
            println!("kafka: SKIPPED, {why}");
            return Ok(());
        }
        let topics = std::sync::Mutex::new(Vec::new());
        let result = self.kafka_rows_on(&brokers, &topics, rows).await;
        // NOTE: the topics are deleted at the end, by a client that never produced to them or
        // cached their metadata. Deleting each after its row, while the publisher's producer
        // was alive, crashed librdkafka 2.12 now and then (SIGSEGV in its metadata cache,
        // `rd_kafka_metadata_cache_find` from `rd_kafka_metadata_update_op`, a known class of
        // bugs with deleted topics: librdkafka #4964, #5051).
        let topics = topics.into_inner().unwrap_or_else(|e| e.into_inner());
        if !topics.is_empty() {
            let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .create()?;
            let names: Vec<&str> = topics.iter().map(String::as_str).collect();
            let _ = admin.delete_topics(&names, &AdminOptions::new()).await;
        }
        result
    }

    /// The Kafka rows; each topic created is added to `topics`.
    pub(crate) async fn kafka_rows_on(
        &self,
        brokers: &str,
        topics: &std::sync::Mutex<Vec<String>>,
        rows: &mut Vec<Row>,
    ) -> anyhow::Result<()> {
        use rdkafka::admin::AdminClient;
        use rdkafka::client::DefaultClientContext;
        let brokers = brokers.to_owned();
        let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()?;
        let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("linger.ms", "5")
            .set("queue.buffering.max.messages", "1000000")
            .create()?;
        let kafka_row = |mode: Mode, label: String, load: Load| {
            let (admin, producer, brokers) = (&admin, &producer, &brokers);
            async move {
                let topic = format!("bench-{label}-{}", self.run_id);
                create_topic(admin, &topic, self.args.partitions).await?;
                topics.lock().unwrap().push(topic.clone());
                let name = format!("bench-kafka-{label}-{}", self.run_id);
                let config = txinbox_kafka::KafkaConfig::new(brokers.clone(), format!("g-{name}"))
                    .topic(topic.clone())
                    .max_buffered_per_partition(load.window as usize)
                    .ordering(self.args.kafka_ordering);
                let source = txinbox_kafka::KafkaSource::new(config)?;
                let publisher = Publisher::Kafka {
                    producer: producer.clone(),
                    topic: topic.clone(),
                    partitions: self.args.partitions,
                    keys: None,
                };
                let row = self
                    .row(
                        "kafka",
                        mode,
                        &name,
                        source,
                        publisher,
                        Some(IdStrategy::Offset),
                        load,
                    )
                    .await;
                let ordering = self.args.kafka_ordering;
                row.map(|mut row| {
                    if mode != Mode::Raw && ordering != txinbox_kafka::Ordering::Partition {
                        row.note = format!("ordering {ordering:?}; {}", row.note);
                    }
                    row
                })
            }
        };
        let window = self.source_rows("kafka", rows, kafka_row).await?;
        self.key_rows(&admin, &producer, &brokers, topics, rows).await?;
        if !self.args.runs("peer") {
            return Ok(());
        }

        let topic = format!("bench-peer-{}", self.run_id);
        create_topic(&admin, &topic, self.args.partitions).await?;
        topics.lock().unwrap().push(topic.clone());
        let publisher = Publisher::Kafka {
            producer: producer.clone(),
            topic: topic.clone(),
            partitions: self.args.partitions,
            keys: None,
        };
        let (pool, brokers_, topic_, group) = (
            self.pool.clone(),
            brokers.clone(),
            topic.clone(),
            format!("g-bench-peer-{}", self.run_id),
        );
        let row = self
            .peer_row(
                "kafka",
                publisher,
                window,
                "hand-written: rdkafka StreamConsumer + sqlx, a transaction per message, offset stored after COMMIT",
                move |probe| kafka_peer(pool, brokers_, topic_, group, probe),
            )
            .await;
        let row = row?;
        print_row(&row);
        rows.push(row);
        Ok(())
    }
}

impl Bench {
    /// A handler waiting on slow I/O (it sleeps `--key-sleep-ms`), records of `--key-keys` keys
    /// on `--partitions` partitions: partition ordering against key ordering, with
    /// `--key-concurrency` transactions and the pool to match. Partition ordering runs one
    /// transaction per partition at a time; key ordering as many as `concurrency`.
    async fn key_rows(
        &self,
        admin: &rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>,
        producer: &rdkafka::producer::FutureProducer,
        brokers: &str,
        topics: &std::sync::Mutex<Vec<String>>,
        rows: &mut Vec<Row>,
    ) -> anyhow::Result<()> {
        use txinbox_kafka::{Keyless, Ordering};
        if self.args.key_messages == 0 || !self.args.runs("keys") {
            return Ok(());
        }
        let mut rates = Vec::new();
        for (mode, ordering) in [
            ("sleep/partition", Ordering::Partition),
            ("sleep/key", Ordering::Key(Keyless::InOrder)),
        ] {
            let label = mode.replace('/', "-");
            let topic = format!("bench-{label}-{}", self.run_id);
            create_topic(admin, &topic, self.args.partitions).await?;
            topics.lock().unwrap().push(topic.clone());
            let name = format!("bench-kafka-{label}-{}", self.run_id);
            let window = KEY_WINDOW;
            let config = txinbox_kafka::KafkaConfig::new(brokers, format!("g-{name}"))
                .topic(topic.clone())
                .max_buffered_per_partition(window as usize)
                .ordering(ordering);
            let source = txinbox_kafka::KafkaSource::new(config)?;
            let publisher = Publisher::Kafka {
                producer: producer.clone(),
                topic,
                partitions: self.args.partitions,
                keys: Some(self.args.key_keys),
            };
            let variant = Variant {
                sleep: Some(Duration::from_millis(self.args.key_sleep_ms)),
                concurrency: Some(self.args.key_concurrency),
                ..Variant::default()
            };
            let load = Load::saturated(self.args.key_messages, window);
            let mut row = self
                .row_with(
                    "kafka",
                    Mode::Batched,
                    &name,
                    source,
                    publisher,
                    Some(IdStrategy::Offset),
                    load,
                    variant,
                )
                .await?;
            row.mode = mode;
            rates.push(row.msgs_per_sec);
            if let [partition, key] = rates[..] {
                row.note = format!(
                    "{:.1}x partition ordering; {} keys on {} partitions; {}",
                    key / partition,
                    self.args.key_keys,
                    self.args.partitions,
                    row.note
                );
            }
            print_row(&row);
            rows.push(row);
        }
        Ok(())
    }
}

/// The key rows' window: enough published and unsettled for every transaction slot.
const KEY_WINDOW: u64 = 1000;

pub(crate) async fn reachable(brokers: &str) -> bool {
    let first = brokers.split(',').next().unwrap_or_default().to_owned();
    matches!(
        tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(first)).await,
        Ok(Ok(_))
    )
}

pub(crate) async fn create_topic(
    admin: &rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>,
    topic: &str,
    partitions: i32,
) -> anyhow::Result<()> {
    use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await?;
    for r in results {
        r.map_err(|(t, e)| anyhow::anyhow!("creating topic {t}: {e}"))?;
    }
    Ok(())
}
