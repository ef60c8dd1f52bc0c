//! A RabbitMQ queue processed effectively once: each deposit message adds to an account balance
//! in PostgreSQL, in the same transaction as its inbox row, and is acknowledged only after that
//! commit. The example publishes a few demo messages first — one of them twice, one without a
//! `message_id` — then consumes until Ctrl-C: the duplicate is acknowledged without a second
//! deposit, the message without ID goes to `txinbox.example.deposits.dlq` with
//! `x-txinbox-reason: missing_id`. Stop RabbitMQ meanwhile (`rabbitmqctl stop_app`, then
//! `start_app`) to watch the source reconnect by itself.
//!
//! Needs RabbitMQ and PostgreSQL (`docker compose up -d`, or `scripts/test` installs them).
//!
//! Run with:
//!
//! ```text
//! AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//! RUST_LOG=info cargo run -p txinbox-amqp --example amqp_consumer
//! ```
//!
//! The directives of `txinbox::redact::LOG_DIRECTIVES` are added to `RUST_LOG` whatever it
//! says (lapin logs the frame carrying the password at trace). `--help` lists the flags and
//! does nothing else.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, ConnectionProperties};
use sqlx::{Executor, Postgres};
use txinbox::{async_trait, Consumer, Context, Handler, HandlerError, Message, PostgresInbox};
use txinbox_amqp::{AmqpConfig, AmqpSource, AmqpTls};

/// Publishes a few demo deposits to RabbitMQ and applies them effectively once, until Ctrl-C.
///
/// Declares the queue `txinbox.example.deposits` (and its retry and dead-letter queues) and
/// creates the table `example_accounts` in the database given, if missing.
#[derive(Debug, clap::Parser)]
#[command(name = "amqp_consumer")]
struct Args {
    /// The RabbitMQ URI (`amqps://` for TLS). Its value is never printed.
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// TLS: a PEM file of CA certificates that sign the broker's certificate (trusted besides
    /// the system's roots).
    #[arg(long, env = "AMQP_CA_FILE", hide_env_values = true)]
    amqp_ca_file: Option<std::path::PathBuf>,
    /// The PostgreSQL database of the inbox and the balances. TLS as with libpq:
    /// `?sslmode=verify-full&sslrootcert=/path/to/ca.pem`. Its value is never printed.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    database_url: String,
}

const QUEUE: &str = "txinbox.example.deposits";

#[derive(serde::Deserialize)]
struct Deposit {
    account: String,
    amount: i64,
}

/// Not idempotent on its own: the inbox makes it effectively once.
struct Deposits;

#[async_trait]
impl Handler<Postgres> for Deposits {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let d: Deposit = msg.json()?; // undecodable → dead-lettered
        sqlx::query(
            "INSERT INTO example_accounts (id, balance) VALUES ($1, $2)
             ON CONFLICT (id) DO UPDATE SET balance = example_accounts.balance + EXCLUDED.balance",
        )
        .bind(&d.account)
        .bind(d.amount)
        .execute(cx.db())
        .await?; // database errors are transient: retried through the retry queue
        tracing::info!(id = %cx.message_id(), account = %d.account, amount = d.amount, "deposited");
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Before anything else: `--help` and a bad flag touch nothing. clap echoes a misspelt
    // flag with its value (`--amqp-ur=amqp://app:pw@mq`): its errors go through the one
    // redaction.
    let Args {
        amqp_url,
        amqp_ca_file,
        database_url,
    } = <Args as clap::Parser>::try_parse().unwrap_or_else(|e| {
        let text = e.render().to_string();
        if e.use_stderr() {
            eprint!("{}", txinbox::redact::url(&text));
        } else {
            print!("{text}");
        }
        std::process::exit(e.exit_code());
    });
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    for directive in txinbox::redact::LOG_DIRECTIVES {
        filter = filter.add_directive(directive.parse()?);
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colour codes only for a terminal, never in a file or a log collector.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();

    // TLS as the URL says (sslmode, sslrootcert, sslcert, sslkey); a refused connection says
    // what to change.
    let pool = PostgresInbox::connect(&database_url, 10).await?.pool().clone();
    txinbox::postgres::migrate(&pool).await?;
    pool.execute(
        "CREATE TABLE IF NOT EXISTS example_accounts (id text PRIMARY KEY, balance bigint NOT NULL)",
    )
    .await?;

    // Connecting declares the work queue, its retry queue and its dead-letter queue.
    let tls = amqp_ca_file.map_or_else(AmqpTls::new, |ca| AmqpTls::new().ca_file(ca));
    let config = AmqpConfig::new(&amqp_url, QUEUE).prefetch(32).tls(tls.clone());
    let source = AmqpSource::connect(config).await?;
    publish_demo_messages(&amqp_url, &tls).await?;

    let consumer = Consumer::builder("example-deposits")
        .source(source)
        .inbox(PostgresInbox::new(pool.clone()))
        .handler(Deposits)
        .concurrency(8)
        .build()?;
    let report = {
        let pool = pool.clone();
        async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let balance: Option<i64> =
                sqlx::query_scalar("SELECT balance FROM example_accounts WHERE id = 'alice'")
                    .fetch_optional(&pool)
                    .await
                    .ok()
                    .flatten();
            tracing::info!(
                ?balance,
                "alice's balance (10 + 5 per run, whatever the duplicates); Ctrl-C to stop"
            );
        }
    };
    tokio::spawn(report);
    consumer
        .run_until(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// Publishes `dep-<run>-1` twice, `dep-<run>-2` once and one message without `message_id`.
async fn publish_demo_messages(amqp_url: &str, tls: &AmqpTls) -> anyhow::Result<()> {
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let conn = tls.connect(amqp_url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    let first = format!("dep-{run}-1");
    let second = format!("dep-{run}-2");
    let messages = [
        (Some(first.as_str()), r#"{"account":"alice","amount":10}"#),
        (Some(first.as_str()), r#"{"account":"alice","amount":10}"#),
        (Some(second.as_str()), r#"{"account":"alice","amount":5}"#),
        (None, r#"{"account":"alice","amount":1000}"#),
    ];
    for (id, payload) in messages {
        let mut props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into());
        if let Some(id) = id {
            props = props.with_message_id(id.into());
        }
        let confirm = channel
            .basic_publish(
                "".into(),
                QUEUE.into(),
                BasicPublishOptions::default(),
                payload.as_bytes(),
                props,
            )
            .await?
            .await?;
        anyhow::ensure!(confirm.is_ack(), "the broker did not confirm the demo message");
    }
    conn.close(200, "published".into()).await?;
    tracing::info!("published 4 demo messages (one duplicate, one without message_id)");
    Ok(())
}
