//! Effectively-once deposits on an at-least-once broker.
//!
//! 1,000 deposit events go through `MemoryBroker`, an in-process broker that misbehaves on
//! purpose: it delivers about 20% of messages twice, and loses about 10% of acknowledgements so
//! those messages come back after their transaction committed (a crash between commit and ack).
//! The producer also re-sends some events with the same ID, reuses one ID with a different
//! payload (a conflict) and sends one payload that is not JSON (undecodable). One event fails
//! transiently on its first attempt and is retried. The handler's update is not idempotent
//! (`balance = balance + amount`), yet the total balance equals the sum of the events sent.
//!
//! Run with:
//!
//! ```text
//! scripts/demo
//! # or, with PostgreSQL already running:
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!     cargo run --release --features memory --example postgres_quickstart
//! ```
//!
//! It drops and recreates the database `txinbox_quickstart` on that server, so every run starts
//! from scratch. `RUST_LOG` (default `warn`) controls the runtime's logs, written to stderr.

use std::collections::HashMap;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::{Connection as _, Postgres};
use tracing_subscriber::EnvFilter;
use txinbox::memory::{MemoryBroker, MemoryStats};
use txinbox::telemetry::{ACK_FAILURES, DUPLICATES};
use txinbox::{Consumer, Context, Handler, HandlerError, Message, PostgresInbox};

const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
const CONSUMER: &str = "quickstart";
const EVENTS: usize = 1_000;
/// The event whose first attempt fails with a transient error.
const FLAKY: &str = "evt-333";

#[derive(serde::Deserialize)]
struct Deposit {
    account: String,
    amount: i64,
}

struct Deposits;

#[txinbox::async_trait]
impl Handler<Postgres> for Deposits {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let deposit: Deposit = msg.json()?; // not JSON: dead-lettered as `undecodable`
        if cx.message_id().as_str() == FLAKY && cx.attempt() == 1 {
            return Err(HandlerError::transient(
                "simulated timeout of a downstream service",
            ));
        }
        // Not idempotent on purpose: applied twice, a balance would be wrong.
        sqlx::query(
            "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        )
        .bind(&deposit.account)
        .bind(deposit.amount)
        .execute(cx.db())
        .await?; // a database error is transient: rolled back, retried later
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Examples install the subscriber and the metrics recorder; the library never does.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .map_err(|_| "a metrics recorder is already installed")?;

    // A fresh database for every run.
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.into());
    let server: PgConnectOptions = url.parse()?;
    let mut admin = PgConnection::connect_with(&server).await?;
    for sql in [
        "DROP DATABASE IF EXISTS txinbox_quickstart WITH (FORCE)",
        "CREATE DATABASE txinbox_quickstart",
    ] {
        sqlx::raw_sql(sql).execute(&mut admin).await?; // one statement each: not in a transaction
    }
    admin.close().await?;
    let options = PostgresInbox::connect_options(server.database("txinbox_quickstart"));
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .connect_with(options)
        .await?;
    txinbox::migrate(&pool).await?;
    let accounts = "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL)";
    sqlx::raw_sql(accounts).execute(&pool).await?;

    // Publish, and work out the expected total from what was published.
    let broker = MemoryBroker::with_seed("deposits", 42);
    broker.set_duplicate_probability(0.2);
    broker.set_lose_ack_probability(0.1);
    let (mut expected, mut resent) = (0i64, 0);
    for i in 0..EVENTS {
        let amount = (i as i64 * 37) % 100 + 1;
        let payload = format!(r#"{{"account": "acct-{}", "amount": {amount}}}"#, i % 50);
        broker.publish(format!("evt-{i}"), payload.clone());
        expected += amount;
        if i % 25 == 0 {
            broker.publish(format!("evt-{i}"), payload); // a producer retry: same ID, same bytes
            resent += 1;
        }
    }
    // evt-7 again with another payload: a conflict, never applied (the first payload seen wins).
    broker.publish("evt-7", r#"{"account": "acct-7", "amount": 1000000}"#);
    broker.publish(format!("evt-{EVENTS}"), &b"\xff\xfe not json"[..]);
    broker.close(); // `run` returns once the queue is drained and everything is settled

    let consumer = Consumer::builder(CONSUMER)
        .source(broker.source())
        .inbox(PostgresInbox::new(pool.clone()))
        .handler(Deposits)
        .build()?;
    consumer.run().await?;

    // What happened, according to the broker, the database and the runtime's metrics.
    let MemoryStats {
        published,
        delivered,
        duplicates_injected,
        acks_lost,
        retried,
        dead_lettered,
        dropped_unsettled,
        ..
    } = broker.stats();
    let (applied, conflicts, undecodable, flaky_attempts, balance): (i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM txinbox.inbox WHERE consumer = $1 AND status = 'processed'),
                (SELECT count(*) FROM txinbox.dead_letters WHERE consumer = $1 AND reason = 'conflict'),
                (SELECT count(*) FROM txinbox.dead_letters WHERE consumer = $1 AND reason = 'undecodable'),
                (SELECT attempts::bigint FROM txinbox.inbox WHERE consumer = $1 AND message_id = $2),
                (SELECT coalesce(sum(balance), 0)::bigint FROM accounts)",
        )
        .bind(CONSUMER)
        .bind(FLAKY)
        .fetch_one(&pool)
        .await?;
    let counters: HashMap<String, u64> = (snapshotter.snapshot().into_vec().into_iter())
        .filter_map(|(key, .., value)| match value {
            DebugValue::Counter(n) => Some((key.key().name().to_owned(), n)),
            _ => None,
        })
        .collect();
    let counter = |name: &str| counters.get(name).copied().unwrap_or(0);
    let (applied, dead) = (applied as u64, (conflicts + undecodable) as u64);
    // Every delivery ends applied, skipped as a duplicate, retried later or dead-lettered.
    let skipped = delivered - applied - retried - dead_lettered - dropped_unsettled;
    let unique = EVENTS + 1;

    println!(
        "txinbox quickstart: {EVENTS} deposits through a faulty at-least-once broker
  published          {published:>6}  ({EVENTS} events, {resent} re-sent, 1 conflicting, 1 undecodable)
  delivered          {delivered:>6}  ({duplicates_injected} broker duplicates, {acks_lost} after a lost ack, {retried} retried)
  unique events      {unique:>6}  ({EVENTS} valid, 1 undecodable)
  applied            {applied:>6}  (inbox rows 'processed'; {FLAKY} succeeded on attempt {flaky_attempts})
  duplicates skipped {skipped:>6}  (acknowledged without running the handler)
  dead-lettered      {dead_lettered:>6}  ({conflicts} conflict, {undecodable} undecodable)
  total balance      {balance:>6}  (expected {expected})"
    );
    let mut failed = Vec::new();
    for (ok, what) in [
        (balance == expected, "total balance != expected"),
        (applied == EVENTS as u64, "applied != valid events"),
        (conflicts >= 1 && undecodable == 1, "missing dead letters"),
        (dead == dead_lettered, "dead letters: database != broker"),
        (flaky_attempts == 1 + retried as i64, "retry attempts miscounted"),
        (skipped == counter(DUPLICATES), "skipped != duplicates metric"),
        (acks_lost == counter(ACK_FAILURES), "lost acks != metric"),
    ] {
        if !ok {
            failed.push(what);
        }
    }
    if !failed.is_empty() {
        eprintln!("FAILED: {}", failed.join("; "));
        std::process::exit(1);
    }
    println!("OK: every deposit applied exactly once despite duplicates, lost acks and a retry");
    Ok(())
}
