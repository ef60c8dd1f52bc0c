//! The ledger (`cargo run --release --example ledger -- --source amqp`): a payment consumer whose effect is not idempotent, made effectively-once by
//! txinbox — and the target of the crash matrix (`tools/chaos/`).
//!
//! It consumes payment events, JSON `{"account": "<id>", "amount_cents": <i64>}`, from Kafka or
//! RabbitMQ and for each one, in a single PostgreSQL transaction with the event's inbox row,
//! adds the amount to `accounts.balance_cents` (upsert) and appends a row to `ledger_entries`.
//! Applying an event twice would show in both; the inbox makes a redelivery, a producer's
//! duplicate or a replay after a crash a no-op. The event ID is the CloudEvents `ce_id` header
//! on Kafka and the `message_id` property on AMQP (each adapter's default). A payload that is
//! not a payment is dead-lettered with reason `undecodable` (Kafka: `<topic>.dlq`; AMQP:
//! `<queue>.dlq`), never retried, never a crash. The tables are created if missing. SIGTERM or
//! Ctrl-C stops it gracefully: intake stops, every received event is finished and acknowledged,
//! the Kafka offsets are committed. On Kafka, a partition the group has committed but the
//! database has no position for (a restored dump, a fresh database) is held with an ERROR until
//! a position is written (`--on-missing-position refuse`, the default), or started from the
//! earliest offset (`earliest`) or from the group's offset (`adopt`). Everything else is the
//! framework's defaults.
//!
//! Needs PostgreSQL and a broker (`docker compose up -d`, or `scripts/test` installs them).
//! Every flag also reads the environment variable shown by `--help`.
//!
//! ```text
//! # RabbitMQ: consume the queue `payments` (declared, with payments.retry and payments.dlq)
//! cargo run --release --example ledger -- --source amqp \
//!     --amqp-url amqp://guest:guest@127.0.0.1:5672/%2f --queue payments \
//!     --database-url postgres://postgres@127.0.0.1:5432/postgres
//!
//! # RabbitMQ over TLS, a quorum queue declared beforehand, a private CA
//! cargo run --release --example ledger -- --source amqp \
//!     --amqp-url 'amqps://ledger:secret@rabbit.internal:5671/%2f' --amqp-ca-file ca.pem \
//!     --amqp-queue-type quorum --queue payments
//!
//! # Kafka: the topic `payments` (and `payments.dlq`) must exist or be auto-created
//! cargo run --release --example ledger -- --source kafka \
//!     --brokers 127.0.0.1:9092 --topic payments --group ledger \
//!     --database-url postgres://postgres@127.0.0.1:5432/postgres
//! ```
//!
//! Then look at `SELECT * FROM accounts` and `SELECT count(*) FROM ledger_entries`. Built with
//! `cargo build -p txinbox-demos --features crash-points --example ledger`, it aborts at a named
//! point when `TXINBOX_CRASH_AT=<point>[:<n>]` says so (see `txinbox::crash`); the crash matrix
//! (`scripts/chaos`, `tools/chaos/`) does that for you.

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use txinbox::{Consumer, PostgresInbox};
use txinbox_amqp::AmqpSource;
use txinbox_demos::flags;
use txinbox_demos::payments::{create_tables, Ledger};
use txinbox_kafka::{KafkaConfig, KafkaSource, MissingPosition, Ordering};

/// Applies payment events from Kafka or RabbitMQ to PostgreSQL balances, effectively once.
#[derive(Debug, Parser)]
#[command(name = "ledger")]
struct Args {
    /// Where the payment events come from.
    #[arg(long, value_enum, env = "LEDGER_SOURCE", hide_env_values = true)]
    source: Source,
    #[command(flatten)]
    kafka: flags::Kafka,
    /// Kafka: the topic of payment events. Dead letters go to `<topic>.dlq`.
    #[arg(long, env = "KAFKA_TOPIC", hide_env_values = true, default_value = "payments")]
    topic: String,
    /// Kafka: the consumer group.
    #[arg(long, env = "KAFKA_GROUP", hide_env_values = true, default_value = "ledger")]
    group: String,
    /// Kafka: librdkafka client properties, KEY=VALUE, repeatable like kcat's `-X`:
    /// `-X security.protocol=SASL_SSL -X sasl.mechanisms=PLAIN -X sasl.username=… -X
    /// sasl.password=…`, `-X ssl.ca.location=/path/ca.pem`, `-X session.timeout.ms=6000`. The
    /// security settings also go to the dead-letter producer. Several in one value are separated
    /// by `,` where a property name and `=` follow it; any other `,` is part of the value
    /// (`sasl.password=a,b`). Values are never printed.
    #[arg(
        short = 'X',
        long = "kafka-property",
        env = "LEDGER_KAFKA_PROPERTIES",
        hide_env_values = true,
        value_parser = flags::KafkaPropertiesParser
    )]
    kafka_properties: Vec<flags::KafkaProperties>,
    /// Kafka: where a partition starts when the group has a committed offset but the database
    /// has no position for it (a restored or fresh database): `refuse` holds the partition and
    /// says how to release it, `earliest` re-applies everything retained (the inbox drops what
    /// was applied), `adopt` counts everything before the group's offset as done.
    #[arg(
        long,
        env = "LEDGER_ON_MISSING_POSITION",
        hide_env_values = true,
        default_value = "refuse"
    )]
    on_missing_position: MissingPosition,
    /// Kafka: which records of a partition may run at the same time: `partition` (one at a
    /// time, in offset order), `key` (each record key in order, keys side by side),
    /// `key-or-unordered` (keyless records in no order) or `unordered`.
    #[arg(
        long,
        env = "LEDGER_KAFKA_ORDERING",
        hide_env_values = true,
        default_value = "partition"
    )]
    kafka_ordering: Ordering,
    #[command(flatten)]
    amqp: flags::Amqp,
    /// AMQP: the queue of payment events (declared if missing, with `<queue>.retry` and
    /// `<queue>.dlq`, of --amqp-queue-type).
    #[arg(long, env = "AMQP_QUEUE", hide_env_values = true, default_value = "payments")]
    queue: String,
    #[command(flatten)]
    postgres: flags::Postgres,
    /// The txinbox consumer name: half of every inbox key; instances of one service share it.
    #[arg(
        long,
        env = "LEDGER_CONSUMER",
        hide_env_values = true,
        default_value = "ledger"
    )]
    consumer_name: String,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Source {
    Kafka,
    Amqp,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Args = txinbox_demos::parse_args();
    txinbox_demos::init_logs("info");
    // Listen before anything else, so a SIGTERM during startup also stops gracefully.
    let shutdown = shutdown_signal()?;

    let inbox = PostgresInbox::connect(&args.postgres.database_url, 10)
        .await
        .context("connecting to PostgreSQL failed; check --database-url / DATABASE_URL")?;
    txinbox::postgres::migrate(inbox.pool())
        .await
        .context("applying txinbox's migrations failed")?;
    create_tables(inbox.pool())
        .await
        .context("creating the ledger's tables failed")?;

    let result = match args.source {
        Source::Kafka => {
            let mut config = KafkaConfig::new(&args.kafka.brokers, &args.group)
                .topic(&args.topic)
                .on_missing_position(args.on_missing_position)
                .ordering(args.kafka_ordering);
            for (key, value) in args.kafka_properties.iter().flat_map(|p| &p.0) {
                config = config.set(key, value);
            }
            let source = KafkaSource::new(config)?;
            // The crash matrix's sabotaged outage run only (see `txinbox_demos::sabotage`).
            #[cfg(feature = "crash-points")]
            let source = txinbox_demos::sabotage::from_env(source);
            tracing::info!(brokers = %args.kafka.brokers, topic = %args.topic, group = %args.group, ordering = %args.kafka_ordering, "ledger consuming from Kafka");
            Consumer::builder(&args.consumer_name)
                .source(source)
                .inbox(inbox)
                .handler(Ledger)
                .build()?
                .run_until(shutdown)
                .await
        }
        Source::Amqp => {
            let source = AmqpSource::connect(args.amqp.config(&args.queue)).await.context(
                "connecting to RabbitMQ failed; check --amqp-url / AMQP_URL and the --amqp-* flags",
            )?;
            #[cfg(feature = "crash-points")]
            let source = txinbox_demos::sabotage::from_env(source);
            tracing::info!(queue = %args.queue, "ledger consuming from RabbitMQ");
            Consumer::builder(&args.consumer_name)
                .source(source)
                .inbox(inbox)
                .handler(Ledger)
                .build()?
                .run_until(shutdown)
                .await
        }
    };
    result.context("the consumer stopped with an error")?;
    tracing::info!("ledger stopped");
    Ok(())
}

/// Completes on SIGTERM or Ctrl-C (SIGINT).
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()> + Send> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM failed")?;
    let mut int = signal(SignalKind::interrupt()).context("listening for SIGINT failed")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: stopping gracefully"),
            _ = int.recv() => tracing::info!("SIGINT: stopping gracefully"),
        }
    })
}
