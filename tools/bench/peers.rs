//! The peers txinbox has to beat: the Kafka and RabbitMQ consumers users write by hand without
//! it, one transaction per message, acknowledged after COMMIT.

use std::sync::Arc;

use anyhow::{bail, Context as _};
use txinbox::sqlx::{self, postgres::PgPool};

use crate::measure::{sent_at, Probe};

/// One message the hand-written way: a `processed_ids` row and, if it is new, the effect, in one
/// transaction. Returns once it has committed.
pub(crate) async fn apply_once(pool: &PgPool, consumer: &str, id: &str, bytes: usize) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    let fresh =
        sqlx::query("INSERT INTO bench_processed_ids (consumer, id) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(consumer)
            .bind(id)
            .execute(&mut *tx)
            .await?
            .rows_affected()
            == 1;
    if fresh {
        sqlx::query("INSERT INTO bench_effects (message_id, bytes) VALUES ($1, $2)")
            .bind(id)
            .bind(bytes as i64)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// The Kafka consumer users write without txinbox: `StreamConsumer`, one message at a time,
/// its offset stored for the auto-commit only after the transaction committed.
pub(crate) async fn kafka_peer(
    pool: PgPool,
    brokers: String,
    topic: String,
    group: String,
    probe: Arc<Probe>,
) -> anyhow::Result<()> {
    use rdkafka::consumer::{Consumer as _, StreamConsumer};
    use rdkafka::Message as _;
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", &group)
        .set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[&topic])?;
    loop {
        let m = consumer.recv().await?;
        let id = format!("{}-{}-{}", m.topic(), m.partition(), m.offset());
        let payload = m.payload().unwrap_or_default();
        apply_once(&pool, &group, &id, payload.len()).await?;
        consumer.store_offset_from_message(&m)?;
        probe.record(sent_at(payload));
    }
}

/// The RabbitMQ consumer users write without txinbox: `basic_consume` with a prefetch, one
/// delivery at a time, acknowledged after the transaction committed.
pub(crate) async fn amqp_peer(
    pool: PgPool,
    url: String,
    queue: String,
    prefetch: u16,
    probe: Arc<Probe>,
) -> anyhow::Result<()> {
    use futures::StreamExt as _;
    let conn = lapin::Connection::connect(&url, lapin::ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .basic_qos(prefetch, lapin::options::BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            queue.as_str().into(),
            "bench-peer".into(),
            lapin::options::BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await?;
    while let Some(delivery) = deliveries.next().await {
        let delivery = delivery?;
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .context("a message without message_id")?;
        apply_once(&pool, "bench-peer", &id, delivery.data.len()).await?;
        delivery.ack(lapin::options::BasicAckOptions::default()).await?;
        probe.record(sent_at(&delivery.data));
    }
    bail!("the RabbitMQ consumer ended")
}
