//! The broker side of a chaos run: a fresh topic or queue, publishing, and the questions asked
//! at the end (is everything consumed, is anything left unacknowledged).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use txinbox::sqlx::{self, PgPool};
use txinbox_amqp::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use txinbox_amqp::lapin::types::{FieldTable, ShortString};
use txinbox_amqp::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use crate::events::Outgoing;

/// Partitions of the crash matrix's topic: several lanes, so racing copies land in different
/// ones.
pub const PARTITIONS: i32 = 4;
const KAFKA_TIMEOUT: Duration = Duration::from_secs(10);

/// A Kafka topic (and its `.dlq`) made for one chaos run.
pub struct Kafka {
    brokers: String,
    topic: String,
    group: String,
    partitions: i32,
    session_timeout_ms: u32,
    producer: FutureProducer,
    /// Per partition, the offset after the last record published (from the delivery reports;
    /// tansu's ListOffsets answers are not reliable enough to ask the broker instead).
    ends: Mutex<BTreeMap<i32, i64>>,
    /// The event ID of every record published, by partition and offset.
    ids: Mutex<BTreeMap<(i32, i64), String>>,
}

impl Kafka {
    /// Creates `ledger-chaos-<tag>` with `partitions` partitions and its dead-letter topic.
    pub async fn create(
        brokers: &str,
        tag: &str,
        partitions: i32,
        session_timeout_ms: u32,
    ) -> anyhow::Result<Kafka> {
        let topic = format!("ledger-chaos-{tag}");
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .context("creating a Kafka admin client")?;
        let dlq = format!("{topic}.dlq");
        let topics = [
            NewTopic::new(&topic, partitions, TopicReplication::Fixed(1)),
            NewTopic::new(&dlq, 1, TopicReplication::Fixed(1)),
        ];
        let options = AdminOptions::new().operation_timeout(Some(KAFKA_TIMEOUT));
        let created = tokio::time::timeout(KAFKA_TIMEOUT * 2, admin.create_topics(&topics, &options))
            .await
            .with_context(|| format!("no answer from the Kafka brokers at {brokers}; is one running there?"))?
            .context("creating the chaos topics")?;
        for result in created {
            result.map_err(|(t, e)| anyhow::anyhow!("creating topic {t}: {e}"))?;
        }
        let producer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("enable.idempotence", "false")
            .create()
            .context("creating a Kafka producer")?;
        Ok(Kafka {
            brokers: brokers.to_owned(),
            group: format!("ledger-chaos-{tag}"),
            partitions,
            session_timeout_ms,
            topic,
            producer,
            ends: Mutex::default(),
            ids: Mutex::default(),
        })
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The ledger's broker flags. A short session timeout lets a restarted ledger get its
    /// partitions a few seconds after the killed one, instead of librdkafka's default 45 s
    /// (the group waits that long for a member that died without leaving).
    pub fn ledger_args(&self) -> Vec<String> {
        [
            "--source=kafka".to_string(),
            format!("--brokers={}", self.brokers),
            format!("--topic={}", self.topic),
            format!("--group={}", self.group),
            format!("--kafka-property=session.timeout.ms={}", self.session_timeout_ms),
            "--kafka-property=heartbeat.interval.ms=300".into(),
        ]
        .into()
    }

    /// Publishes `messages` in order, each with its ID in the `ce_id` header, and waits for every
    /// delivery report. A first copy goes to the partition its ID hashes to, a second copy to the
    /// next one: a racing pair is processed concurrently by two lanes.
    pub async fn publish(&self, messages: &[Outgoing]) -> anyhow::Result<()> {
        let mut reports = Vec::with_capacity(messages.len());
        for m in messages {
            let partition = (stable_hash(&m.id) + m.copy as u64) % self.partitions as u64;
            let headers = OwnedHeaders::new().insert(Header {
                key: "ce_id",
                value: Some(m.id.as_bytes()),
            });
            let record = FutureRecord::to(&self.topic)
                .key(m.key.as_bytes())
                .payload(&m.payload)
                .partition(partition as i32)
                .headers(headers);
            let report = self
                .producer
                .send_result(record)
                .map_err(|(e, _)| anyhow::anyhow!("producing to {}: {e}", self.topic))?;
            reports.push(report);
        }
        for (report, m) in reports.into_iter().zip(messages) {
            let delivered = report
                .await
                .context("the producer went away")?
                .map_err(|(e, _)| anyhow::anyhow!("producing to {}: {e}", self.topic))?;
            let mut ends = self.ends.lock().unwrap();
            let end = ends.entry(delivered.partition).or_insert(0);
            *end = (*end).max(delivered.offset + 1);
            self.ids
                .lock()
                .unwrap()
                .insert((delivered.partition, delivered.offset), m.id.clone());
        }
        Ok(())
    }

    /// Moves the run to the consumer group `<group>-<suffix>`: `consumed` and
    /// `unacknowledged` read that group's offsets from now on. Returns the new group's name.
    pub fn move_group(&mut self, suffix: &str) -> String {
        self.group = format!("{}-{suffix}", self.group);
        self.group.clone()
    }

    /// The event ID of the record at `offset` of `partition`, if this run published it.
    pub fn id_at(&self, partition: i32, offset: i64) -> Option<String> {
        self.ids.lock().unwrap().get(&(partition, offset)).cloned()
    }

    /// The offset after the last published record, for every partition (0: none published).
    pub fn ends(&self) -> Vec<i64> {
        let ends = self.ends.lock().unwrap();
        (0..self.partitions)
            .map(|p| ends.get(&p).copied().unwrap_or(0))
            .collect()
    }

    /// The group's committed offset of every partition (`None`: nothing committed).
    pub async fn committed_offsets(&self) -> anyhow::Result<Vec<Option<i64>>> {
        let (brokers, topic, group) = (self.brokers.clone(), self.topic.clone(), self.group.clone());
        let partitions = self.partitions;
        tokio::task::spawn_blocking(move || {
            // Asking for committed offsets does not join the group.
            let consumer: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", &group)
                .create()?;
            let mut tpl = TopicPartitionList::new();
            for p in 0..partitions {
                tpl.add_partition(&topic, p);
            }
            let committed = consumer.committed_offsets(tpl, KAFKA_TIMEOUT)?;
            Ok((0..partitions)
                .map(
                    |p| match committed.find_partition(&topic, p).map(|e| e.offset()) {
                        Some(Offset::Offset(o)) => Some(o),
                        _ => None,
                    },
                )
                .collect())
        })
        .await?
    }

    /// The next offsets stored in the database with the effects, per partition (the highest
    /// over consumer names).
    pub async fn database_positions(&self, pool: &PgPool) -> anyhow::Result<BTreeMap<i32, i64>> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT lane, max(next_position) FROM txinbox.positions WHERE source = $1 GROUP BY lane",
        )
        .bind(&self.topic)
        .fetch_all(pool)
        .await?;
        rows.into_iter()
            .map(|(lane, next)| Ok((lane.parse().context("a partition lane")?, next)))
            .collect()
    }

    /// Whether the database positions and the group's committed offsets both reached the end
    /// of every partition. A ledger that holds only some partitions (killed members keep theirs
    /// until their session times out) or has not committed yet is not done.
    pub async fn consumed(&self, pool: &PgPool) -> anyhow::Result<bool> {
        let positions = self.database_positions(pool).await?;
        let committed = self.committed_offsets().await?;
        Ok(self.ends().iter().enumerate().all(|(p, end)| {
            *end == 0 || (positions.get(&(p as i32)) == Some(end) && committed[p] == Some(*end))
        }))
    }

    /// Records not acknowledged: per partition, the end of the partition minus the group's
    /// committed offset, or minus the database position. Both must be zero once the last
    /// ledger stopped.
    pub async fn unacknowledged(&self, pool: &PgPool) -> anyhow::Result<(u64, Vec<String>)> {
        let high = self.ends();
        let committed = self.committed_offsets().await?;
        let positions = self.database_positions(pool).await?;
        let mut total = 0;
        let mut details = Vec::new();
        for (p, h) in high.iter().enumerate() {
            let group = committed[p].unwrap_or(0);
            let db = positions.get(&(p as i32)).copied().unwrap_or(0);
            let behind = (h - group).max(0).max(h - db) as u64;
            if behind > 0 {
                details.push(format!(
                    "partition {p}: end {h}, group committed {group}, database position {db}"
                ));
            }
            total += behind;
        }
        Ok((total, details))
    }

    /// Deletes the topics.
    pub async fn delete(&self) -> anyhow::Result<()> {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .create()?;
        let dlq = format!("{}.dlq", self.topic);
        let options = AdminOptions::new().operation_timeout(Some(KAFKA_TIMEOUT));
        admin
            .delete_topics(&[self.topic.as_str(), dlq.as_str()], &options)
            .await?;
        Ok(())
    }
}

/// FNV-1a: a partition choice that does not change between runs or Rust versions.
fn stable_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A RabbitMQ queue (with `.retry` and `.dlq`) made for one chaos run.
pub struct Amqp {
    queue: String,
    /// `classic` or `quorum`.
    queue_type: String,
    /// The ledger's AMQP flags (queue type, TLS files), as arguments.
    flags: Vec<String>,
    connection: Connection,
    channel: Channel,
}

impl Amqp {
    /// Declares `ledger-chaos-<tag>` with its retry and dead-letter queues beforehand, as the
    /// ledger would with the same flags (`--amqp-queue-type`: classic or quorum).
    pub async fn create(flags: &txinbox_demos::flags::Amqp, tag: &str) -> anyhow::Result<Amqp> {
        let queue = format!("ledger-chaos-{tag}");
        let connection = tokio::time::timeout(
            Duration::from_secs(10),
            flags
                .tls()
                .connect(&flags.amqp_url, ConnectionProperties::default()),
        )
        .await
        .context("no answer from RabbitMQ within 10 s; check --amqp-url / AMQP_URL")?
        .context("connecting to RabbitMQ failed; check --amqp-url / AMQP_URL and the --amqp-* flags")?;
        let channel = connection.create_channel().await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        for (name, arguments) in flags.config(&queue).topology() {
            let options = QueueDeclareOptions {
                durable: true,
                ..Default::default()
            };
            channel
                .queue_declare(name.as_str().into(), options, arguments)
                .await
                .with_context(|| format!("declaring {name}"))?;
        }
        Ok(Amqp {
            queue,
            queue_type: flags.amqp_queue_type.to_string(),
            flags: flags.to_args(),
            connection,
            channel,
        })
    }

    /// The queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// `classic` or `quorum`.
    pub fn queue_type(&self) -> &str {
        &self.queue_type
    }

    /// The ledger's broker flags (the URL goes in `AMQP_URL`).
    pub fn ledger_args(&self) -> Vec<String> {
        let mut args = vec!["--source=amqp".into(), format!("--queue={}", self.queue)];
        args.extend(self.flags.iter().cloned());
        args
    }

    /// Publishes persistent messages with their ID as `message_id` and waits for every
    /// publisher confirm. A racing pair sits back to back in the queue, so two of the ledger's
    /// concurrent tasks take it at the same time.
    pub async fn publish(&self, messages: &[Outgoing]) -> anyhow::Result<()> {
        let mut confirms = Vec::with_capacity(messages.len());
        for m in messages {
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into())
                .with_message_id(m.id.as_str().into());
            let confirm = self
                .channel
                .basic_publish(
                    ShortString::default(),
                    self.queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &m.payload,
                    properties,
                )
                .await
                .with_context(|| format!("publishing to {}", self.queue))?;
            confirms.push(confirm);
        }
        for confirm in confirms {
            let confirmation = confirm.await.context("waiting for a publisher confirm")?;
            ensure!(
                confirmation.is_ack(),
                "RabbitMQ refused a message for {}",
                self.queue
            );
        }
        Ok(())
    }

    /// `(messages ready, consumers)` of a queue, by a passive declare.
    async fn stats(&self, queue: &str) -> anyhow::Result<(u32, u32)> {
        let options = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let q = self
            .channel
            .queue_declare(queue.into(), options, FieldTable::default())
            .await
            .with_context(|| format!("passive declare of {queue}"))?;
        Ok((q.message_count(), q.consumer_count()))
    }

    /// Whether the work queue and the retry queue hold no ready message.
    pub async fn consumed(&self) -> anyhow::Result<bool> {
        let (work, _) = self.stats(&self.queue).await?;
        let (retry, _) = self.stats(&format!("{}.retry", self.queue)).await?;
        Ok(work == 0 && retry == 0)
    }

    /// Messages ready in the work and retry queues once no consumer is attached any more (a
    /// killed ledger's unacknowledged deliveries are back in the queue by then).
    pub async fn ready_when_detached(&self) -> anyhow::Result<u64> {
        let started = std::time::Instant::now();
        loop {
            let (work, consumers) = self.stats(&self.queue).await?;
            if consumers == 0 {
                let (retry, _) = self.stats(&format!("{}.retry", self.queue)).await?;
                return Ok(u64::from(work + retry));
            }
            if started.elapsed() > Duration::from_secs(15) {
                bail!("{} still has {consumers} consumers after 15 s", self.queue);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Messages in the work and retry queues once no consumer is attached any more (a killed
    /// ledger's unacknowledged deliveries are back in the queue by then).
    pub async fn unacknowledged(&self) -> anyhow::Result<(u64, Vec<String>)> {
        let retry = format!("{}.retry", self.queue);
        let started = std::time::Instant::now();
        loop {
            let (work, consumers) = self.stats(&self.queue).await?;
            if consumers == 0 {
                let (in_retry, _) = self.stats(&retry).await?;
                let mut details = Vec::new();
                if work > 0 {
                    details.push(format!("{}: {work} messages", self.queue));
                }
                if in_retry > 0 {
                    details.push(format!("{retry}: {in_retry} messages"));
                }
                return Ok((u64::from(work + in_retry), details));
            }
            if started.elapsed() > Duration::from_secs(15) {
                bail!(
                    "{} still has {consumers} consumers 15 s after the last ledger stopped",
                    self.queue
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Deletes the three queues and closes the connection.
    pub async fn delete(&self) -> anyhow::Result<()> {
        for name in [
            self.queue.clone(),
            format!("{}.retry", self.queue),
            format!("{}.dlq", self.queue),
        ] {
            self.channel
                .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        self.connection.close(200, "chaos run done".into()).await?;
        Ok(())
    }
}
