//! Outbox relay throughput, side by side (`cargo run --release --example outbox_bench`): how fast a relay drains a backlog of outbox rows,
//! by publisher (none — the database's share alone —, Kafka, RabbitMQ with 1 or 4 channels),
//! batch size and number of keys. One key's rows are published one after another (each waits
//! for its confirmation), so the 1-key rows show the per-key ceiling.
//!
//! ```text
//! cargo run --release --example outbox_bench              # DATABASE_URL, AMQP_URL, KAFKA_BROKERS
//! cargo run --release --example outbox_bench -- 5000      # rows per scenario (default 2000)
//! ```
//!
//! Needs PostgreSQL (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/postgres`; a
//! database is created and dropped). Kafka rows need `KAFKA_BROKERS` (e.g. tansu from
//! `scripts/lib/tansu.sh`); RabbitMQ rows need a broker at `AMQP_URL` (default guest on
//! 127.0.0.1). A missing broker skips its rows. Figures depend on the machine: compare rows,
//! not runs.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::Executor;
use txinbox::async_trait;
use txinbox::outbox::{OutboxMessage, PublishError, Publisher, Relay, RelayConfig};
use txinbox::sqlx;

/// Confirms everything at once: what is left is the relay's database work.
struct Nothing;

#[async_trait]
impl Publisher for Nothing {
    async fn publish(&self, _: &OutboxMessage) -> Result<(), PublishError> {
        Ok(())
    }
}

async fn fill(pool: &PgPool, destination: &str, rows: usize, keys: usize) -> anyhow::Result<()> {
    pool.execute("TRUNCATE txinbox.outbox").await?;
    let ids: Vec<String> = (0..rows).map(|i| format!("bench-{i}")).collect();
    let keys: Vec<Vec<u8>> = (0..rows).map(|i| format!("k{}", i % keys).into_bytes()).collect();
    let payload = vec![b'x'; 200];
    let payloads: Vec<&[u8]> = (0..rows).map(|_| payload.as_slice()).collect();
    sqlx::query(
        "INSERT INTO txinbox.outbox (message_id, destination, message_key, payload)
         SELECT id, $2, k, p FROM unnest($1::text[], $3::bytea[], $4::bytea[]) AS u(id, k, p)",
    )
    .bind(&ids)
    .bind(destination)
    .bind(&keys)
    .bind(&payloads)
    .execute(pool)
    .await?;
    Ok(())
}

async fn drain<P: Publisher>(pool: &PgPool, publisher: P, batch: usize) -> anyhow::Result<(Duration, usize)> {
    let relay = Relay::new(pool.clone(), publisher, RelayConfig::default().batch_size(batch))?;
    let started = Instant::now();
    let mut published = 0;
    loop {
        let round = relay.relay_once().await?;
        published += round.published;
        if round.claimed == 0 {
            break;
        }
        anyhow::ensure!(
            round.failed == 0,
            "publish failures in a benchmark round: {round:?}"
        );
    }
    Ok((started.elapsed(), published))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let rows: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(2000);
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let admin: PgConnectOptions = url.parse().context("DATABASE_URL does not parse")?;
    let db = format!("txinbox_outbox_bench_{}", std::process::id());
    // TLS as DATABASE_URL says (sslmode, sslrootcert, …); a refused connection says what to
    // change.
    let conn = txinbox::PostgresInbox::connect(&url, 1)
        .await
        .context("connect to DATABASE_URL")?
        .pool()
        .clone();
    conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .await?;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(txinbox::PostgresInbox::connect_options(
            admin.clone().database(&db),
        ))
        .await?;
    txinbox::postgres::migrate(&pool).await?;

    let stamp = std::process::id();
    let kafka = match std::env::var("KAFKA_BROKERS") {
        Ok(brokers) => Some(std::sync::Arc::new(
            txinbox_kafka::KafkaPublisher::builder(brokers)
                .set("linger.ms", "1")
                .build()?,
        )),
        Err(_) => {
            eprintln!("KAFKA_BROKERS not set: no Kafka rows");
            None
        }
    };
    let amqp_url =
        std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let amqp_queue = format!("txinbox-outbox-bench-{stamp}");
    let amqp = match lapin_queue(&amqp_url, &amqp_queue).await {
        Ok(()) => Some(()),
        Err(e) => {
            eprintln!("RabbitMQ unavailable ({e}): no RabbitMQ rows");
            None
        }
    };

    println!("outbox relay: {rows} rows of 200 bytes per scenario, one relay, rows/s (higher is better)");
    println!(
        "{:<10} {:>6} {:>6} {:>12} {:>10}",
        "publisher", "batch", "keys", "rows/s", "time"
    );
    for publisher in ["none", "kafka", "rabbit/1ch", "rabbit/4ch"] {
        for (batch, keys) in [(1, 64), (32, 1), (32, 64), (256, 1), (256, 64)] {
            let destination = match publisher {
                "kafka" => format!("txinbox-outbox-bench-{stamp}"),
                _ => amqp_queue.clone(),
            };
            let result = match publisher {
                "none" => {
                    fill(&pool, &destination, rows, keys).await?;
                    Some(drain(&pool, Nothing, batch).await?)
                }
                "kafka" => match &kafka {
                    Some(p) => {
                        fill(&pool, &destination, rows, keys).await?;
                        Some(drain(&pool, Shared(p.clone()), batch).await?)
                    }
                    None => None,
                },
                _ => match amqp {
                    Some(()) => {
                        fill(&pool, &destination, rows, keys).await?;
                        let channels = if publisher == "rabbit/1ch" { 1 } else { 4 };
                        let p = txinbox_amqp::AmqpPublisher::connect(&amqp_url)
                            .await?
                            .channels(channels);
                        Some(drain(&pool, p, batch).await?)
                    }
                    None => None,
                },
            };
            if let Some((elapsed, published)) = result {
                anyhow::ensure!(published == rows, "{publisher}: published {published} of {rows}");
                println!(
                    "{:<10} {:>6} {:>6} {:>12.0} {:>9.2}s",
                    publisher,
                    batch,
                    keys,
                    rows as f64 / elapsed.as_secs_f64(),
                    elapsed.as_secs_f64()
                );
            }
        }
    }

    if amqp.is_some() {
        let _ = delete_queue(&amqp_url, &amqp_queue).await;
    }
    // The Kafka producer's drop flushes and joins its threads: not on a runtime worker.
    tokio::task::spawn_blocking(move || drop(kafka)).await?;
    pool.close().await;
    conn.execute(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
    )))
    .await?;
    Ok(())
}

/// Lets the benchmark keep one Kafka producer across scenarios.
struct Shared(std::sync::Arc<txinbox_kafka::KafkaPublisher>);

#[async_trait]
impl Publisher for Shared {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        self.0.publish(message).await
    }
}

async fn lapin_queue(url: &str, queue: &str) -> anyhow::Result<()> {
    use txinbox_amqp::lapin::{
        options::QueueDeclareOptions, types::FieldTable, Connection, ConnectionProperties,
    };
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    conn.close(200, "declared".into()).await?;
    Ok(())
}

async fn delete_queue(url: &str, queue: &str) -> anyhow::Result<()> {
    use txinbox_amqp::lapin::{options::QueueDeleteOptions, Connection, ConnectionProperties};
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.queue_delete(queue.into(), QueueDeleteOptions::default())
        .await?;
    conn.close(200, "deleted".into()).await?;
    Ok(())
}
