//! A Kafka consumer service with effectively-once effects: `txinbox-kafka` + PostgreSQL.
//!
//! A plain rdkafka producer publishes 500 deposit events over 3 partitions of a fresh topic,
//! each with a CloudEvents ID in the `ce_id` header; 100 of them are sent a second time (same
//! ID, same payload, another partition) and one record is not JSON. A txinbox `Consumer` with a
//! `KafkaSource` applies them with a non-idempotent update (`balance = balance + amount`): each
//! event's inbox row, its update and its partition's next offset commit in one transaction,
//! and the offset reaches Kafka only afterwards. The repeated IDs are skipped as duplicates, the
//! malformed record goes to `<topic>.dlq` with `txinbox.dlq.*` headers. The example prints the
//! balances and the stored positions, and exits non-zero if the total disagrees.
//!
//! Needs a Kafka-protocol broker at `KAFKA_BROKERS` (default `127.0.0.1:9092`; e.g. tansu via
//! `source scripts/lib/tansu.sh && ensure_tansu`) and PostgreSQL at `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`; the example drops and recreates the database
//! `txinbox_kafka_example` there).
//!
//! Run with:
//!
//! ```text
//! cargo run -p txinbox-kafka --example kafka_consumer
//! ```
//!
//! Over TLS or SASL, give the client properties as `-X key=value` (like kcat), e.g.
//! `cargo run -p txinbox-kafka --example kafka_consumer -- -X security.protocol=SSL -X
//! ssl.ca.location=/var/lib/txinbox/tls/ca.pem --brokers 127.0.0.1:9094` against the TLS
//! listener `scripts/lib/tansu.sh`'s `ensure_tansu_tls` starts.
//!
//! `RUST_LOG` (default `warn,txinbox_kafka=info`) controls the logs, written to stderr; the
//! directives of `txinbox::redact::LOG_DIRECTIVES` are added whatever it says, so no dependency
//! logs a credential. `--help` lists the flags and does nothing else.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use tracing_subscriber::EnvFilter;
use txinbox::sqlx::postgres::PgConnectOptions;
use txinbox::sqlx::{self, Executor as _, Postgres};
use txinbox::{Consumer, Context, Handler, HandlerError, Message, PostgresInbox};
use txinbox_kafka::{KafkaConfig, KafkaSource};

/// Publishes demo deposits to a fresh topic and applies them effectively once.
///
/// Drops and recreates the database `txinbox_kafka_example` on the PostgreSQL server given.
#[derive(Debug, clap::Parser)]
#[command(name = "kafka_consumer")]
struct Args {
    /// Kafka bootstrap brokers, comma-separated host:port. Its value is never printed.
    #[arg(
        long,
        env = "KAFKA_BROKERS",
        hide_env_values = true,
        default_value = "127.0.0.1:9092"
    )]
    brokers: String,
    /// The PostgreSQL server (its database `txinbox_kafka_example` is recreated). TLS as with
    /// libpq: `?sslmode=verify-full&sslrootcert=/path/to/ca.pem`. Its value is never printed.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    database_url: String,
    /// A librdkafka client property, KEY=VALUE, repeatable like kcat's `-X`, for the admin
    /// client, the producer and the consumer: `-X security.protocol=SSL -X
    /// ssl.ca.location=/path/ca.pem`, or `-X security.protocol=SASL_SSL -X
    /// sasl.mechanisms=SCRAM-SHA-512 -X sasl.username=… -X sasl.password=…`. Several in one value
    /// (and in KAFKA_PROPERTIES) are separated by `,` where a property name and `=` follow it.
    /// Values are never printed.
    #[arg(
        short = 'X',
        long = "kafka-property",
        env = "KAFKA_PROPERTIES",
        hide_env_values = true,
        value_name = "KEY=VALUE"
    )]
    kafka_properties: Vec<String>,
}

const CONSUMER: &str = "kafka-example";
const EVENTS: usize = 500;

#[derive(serde::Deserialize)]
struct Deposit {
    account: String,
    amount: i64,
}

/// `balance = balance + amount`: applying an event twice would be visible.
struct Deposits;

#[txinbox::async_trait]
impl Handler<Postgres> for Deposits {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let d: Deposit = msg.json()?; // not JSON: permanent, dead-lettered as `undecodable`
        sqlx::query(
            "INSERT INTO accounts (id, balance) VALUES ($1, $2)
             ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        )
        .bind(&d.account)
        .bind(d.amount)
        .execute(cx.db())
        .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Before anything else: `--help` and a bad flag touch nothing. clap echoes a misspelt
    // flag with its value (`--databse-url=postgres://app:pw@db`): its errors go through the
    // one redaction.
    let Args {
        brokers,
        database_url,
        kafka_properties,
    } = <Args as clap::Parser>::try_parse().unwrap_or_else(|e| {
        let text = e.render().to_string();
        if e.use_stderr() {
            eprint!("{}", txinbox::redact::url(&text));
        } else {
            print!("{text}");
        }
        std::process::exit(e.exit_code());
    });
    let mut properties = Vec::new();
    for text in &kafka_properties {
        match txinbox_kafka::parse_properties(text) {
            Ok(p) => properties.extend(p),
            Err(why) => {
                // Not the value: it may hold a secret.
                eprintln!(
                    "error: -X / --kafka-property: {why} (the value is not shown: it may hold a secret)"
                );
                std::process::exit(2);
            }
        }
    }
    // Every client of the example (admin, producer, consumer) gets the same security settings.
    let client_config = || {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &brokers);
        for (k, v) in &properties {
            c.set(k, v);
        }
        c
    };
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn,txinbox_kafka=info".into());
    for directive in txinbox::redact::LOG_DIRECTIVES {
        filter = filter.add_directive(directive.parse()?);
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal, never in a file or a log collector.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();

    // A fresh database with the inbox tables and the application's table.
    // TLS as the URL says (sslmode, sslrootcert, sslcert, sslkey); a refused connection says
    // what to change.
    let admin = PostgresInbox::connect(&database_url, 1).await?;
    admin
        .pool()
        .execute("DROP DATABASE IF EXISTS txinbox_kafka_example WITH (FORCE)")
        .await?;
    admin
        .pool()
        .execute("CREATE DATABASE txinbox_kafka_example")
        .await?;
    admin.pool().close().await;
    let admin_db: PgConnectOptions = database_url.parse()?;
    let pool = PostgresInbox::connect_with(admin_db.database("txinbox_kafka_example"), 8)
        .await?
        .pool()
        .clone();
    txinbox::postgres::migrate(&pool).await?;
    pool.execute("CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL)")
        .await?;

    // A fresh topic, so reruns against the same broker start clean.
    let stamp = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let topic = format!("deposits-example-{stamp}");
    let admin: AdminClient<DefaultClientContext> = client_config().create()?;
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let dlq = format!("{topic}.dlq");
    let topics = [
        NewTopic::new(&topic, 3, TopicReplication::Fixed(1)),
        NewTopic::new(&dlq, 1, TopicReplication::Fixed(1)),
    ];
    for result in admin.create_topics(&topics, &options).await? {
        result.map_err(|(t, e)| format!("creating topic {t}: {e}"))?;
    }

    // The producer: any Kafka client would do; txinbox is not involved.
    let producer: FutureProducer = client_config().create()?;
    let mut expected = 0;
    let mut reports: Vec<rdkafka::producer::DeliveryFuture> = Vec::new();
    for i in 0..EVENTS {
        let id = format!("evt-{i}");
        let amount = (i % 10) as i64 + 1;
        expected += amount;
        let payload = format!(r#"{{"account":"acct-{}","amount":{amount}}}"#, i % 5);
        let copies = if i % 5 == 0 { 2 } else { 1 }; // 100 events sent twice
        for copy in 0..copies {
            let headers = OwnedHeaders::new().insert(Header {
                key: "ce_id",
                value: Some(&id),
            });
            let record = FutureRecord::to(&topic)
                .key(&id)
                .payload(&payload)
                .partition(((i + copy) % 3) as i32)
                .headers(headers);
            // Pipelined: queue everything, then wait for every delivery report.
            reports.push(producer.send_result(record).map_err(|(e, _)| e)?);
        }
    }
    for report in reports {
        report.await?.map_err(|(e, _)| e)?;
    }
    let bad = OwnedHeaders::new().insert(Header {
        key: "ce_id",
        value: Some("evt-bad"),
    });
    producer
        .send(
            FutureRecord::to(&topic)
                .key("evt-bad")
                .payload("{oops")
                .partition(0)
                .headers(bad),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)?;
    println!(
        "published {} records ({EVENTS} events, 100 sent twice, 1 malformed) to {topic}",
        EVENTS + 101
    );

    // The consumer service.
    let inbox = PostgresInbox::new(pool.clone());
    let mut config = KafkaConfig::new(&brokers, format!("{topic}-group"))
        .topic(&topic)
        // Any librdkafka property passes through. A short session timeout makes a new group
        // form quickly on tansu, which waits about half of it for more members to join.
        .set("session.timeout.ms", "6000");
    for (k, v) in &properties {
        // The security settings reach the dead-letter producer too.
        config = config.set(k, v);
    }
    let source = KafkaSource::new(config)?;
    let consumer = Consumer::builder(CONSUMER)
        .source(source)
        .inbox(inbox)
        .handler(Deposits)
        .build()?;
    let done = {
        let pool = pool.clone();
        async move {
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(60) {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM txinbox.inbox WHERE status IN ('processed', 'dead_lettered')",
                )
                .fetch_one(&pool)
                .await
                .unwrap_or(0);
                if n as usize > EVENTS {
                    // every event plus the malformed one
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    consumer.run_until(done).await?;

    let balances: Vec<(String, i64)> = sqlx::query_as("SELECT id, balance FROM accounts ORDER BY id")
        .fetch_all(&pool)
        .await?;
    let positions: Vec<(String, i64)> =
        sqlx::query_as("SELECT lane, next_position FROM txinbox.positions WHERE consumer = $1 ORDER BY lane")
            .bind(CONSUMER)
            .fetch_all(&pool)
            .await?;
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM txinbox.dead_letters")
        .fetch_one(&pool)
        .await?;
    let total: i64 = balances.iter().map(|(_, b)| b).sum();
    for (account, balance) in &balances {
        println!("  {account}: {balance}");
    }
    println!("positions stored with the effects (partition → next offset): {positions:?}");
    println!("dead letters recorded: {dead} (also on {topic}.dlq)");
    println!("total balance {total}, expected {expected}");
    if total != expected || dead != 1 {
        return Err("the balances disagree with the events sent".into());
    }
    println!("ok: every event applied exactly once");
    Ok(())
}
