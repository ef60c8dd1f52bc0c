//! Effectively-once deposits on an at-least-once broker, with no services to install.
//!
//! 1,000 deposit events go through `MemoryBroker`, an in-process broker that misbehaves on
//! purpose: it delivers about 20% of messages twice and loses about 10% of acknowledgements, so
//! those messages come back after their transaction committed (a crash between commit and ack).
//! Midway the consumer process "crashes" for real (its task is aborted with transactions open)
//! and a new consumer takes over. The producer also re-sends some events with the same ID,
//! reuses one ID with a different payload (a conflict: whichever of the two payloads the consumer
//! sees first is applied and the other is dead-lettered; messages outside a lane have no order,
//! so either can come first) and sends one payload that is not JSON.
//! One event fails transiently on its first attempt and is retried (a broker duplicate that
//! overlaps that attempt is a first attempt too, so it may take two retries). The handler's update is not
//! idempotent (`balance = balance + amount`), yet the total balance equals the sum of the events
//! sent. The example prints a report and exits non-zero if any figure disagrees.
//!
//! The inbox is SQLite (a file in a temporary directory); `--postgres` runs the same on
//! PostgreSQL at `--database-url` or `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`; it drops and recreates the database
//! `txinbox_quickstart` there). TLS is set in the URL as with libpq: a managed database wants
//! `?sslmode=verify-full&sslrootcert=/path/to/provider-ca.pem`.
//!
//! Run with:
//!
//! ```text
//! cargo run --example quickstart
//! cargo run --example quickstart -- --postgres
//! cargo run --example quickstart -- --database-url 'postgres://app@db.example.com/app?sslmode=verify-full&sslrootcert=ca.pem'
//! ```
//!
//! `RUST_LOG` (default `warn`) controls the runtime's logs, written to stderr; the directives
//! of `txinbox::redact::LOG_DIRECTIVES` are added whatever it says, so no dependency logs a
//! credential. `--help` says all this and does nothing else.

use std::collections::HashMap;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Postgres, Sqlite};
use tracing_subscriber::EnvFilter;
use txinbox::memory::{MemoryBroker, MemoryStats};
use txinbox::telemetry::{ACK_FAILURES, DUPLICATES, PROCESSED};
use txinbox::{Consumer, Context, Handler, HandlerError, InboxStore, Message, PostgresInbox, SqliteInbox};

const USAGE: &str = "\
Effectively-once deposits on an at-least-once broker: 1,000 events through a broker that
delivers twice, loses acknowledgements and crashes; the balances still add up.

Usage: quickstart [--postgres] [--database-url URL]

Options:
      --postgres            Run on PostgreSQL at DATABASE_URL (default
                            postgres://postgres@127.0.0.1:5432/postgres; drops and recreates its
                            database txinbox_quickstart) instead of SQLite in a temporary directory
      --database-url URL    Run on PostgreSQL at URL (implies --postgres). TLS as with libpq:
                            ?sslmode=verify-full&sslrootcert=/path/to/ca.pem (or sslmode=require;
                            sslcert and sslkey for a client certificate). Never printed.
  -h, --help                Print help

RUST_LOG (default warn) controls the logs, written to stderr.
";

/// The PostgreSQL URL to run on, if `--postgres` or `--database-url` was given (`--postgres`
/// reads `DATABASE_URL`). `--help` prints [`USAGE`] and exits 0; anything else is refused with
/// exit code 2 (shown through the one redaction: a misspelt flag may carry a URL with a
/// password). Nothing has run yet either way.
fn postgres_flag() -> Option<String> {
    let mut postgres = false;
    let mut url = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if let Some(value) = arg.strip_prefix("--database-url=") {
            url = Some(value.to_owned());
            continue;
        }
        match arg.as_str() {
            "--postgres" => postgres = true,
            "--database-url" => match args.next() {
                Some(value) => url = Some(value),
                None => {
                    eprintln!("error: --database-url needs a value\n\n{USAGE}");
                    std::process::exit(2);
                }
            },
            "-h" | "--help" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            other => {
                eprintln!(
                    "error: unexpected argument '{}'\n\n{USAGE}",
                    txinbox::redact::url(other)
                );
                std::process::exit(2);
            }
        }
    }
    url.or_else(|| {
        postgres.then(|| {
            std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
        })
    })
}

const CONSUMER: &str = "quickstart";
const EVENTS: usize = 1_000;
/// The event whose first attempt fails with a transient error.
const FLAKY: &str = "evt-333";
/// The event sent a second time with another payload: a conflict.
const CONFLICTED: &str = "evt-7";
/// The other payload's amount.
const CONFLICTING_AMOUNT: i64 = 1_000_000;

/// Event `i`'s deposit: `(payload, amount)`.
fn deposit(i: usize) -> (String, i64) {
    let amount = (i as i64 * 37) % 100 + 1;
    (
        format!(r#"{{"account": "acct-{}", "amount": {amount}}}"#, i % 50),
        amount,
    )
}

#[derive(serde::Deserialize)]
struct Deposit {
    account: String,
    amount: i64,
}

struct Deposits;

/// The same handler for both databases; only the placeholder syntax differs.
macro_rules! deposits_on {
    ($db:ty, $upsert:literal) => {
        #[txinbox::async_trait]
        impl Handler<$db> for Deposits {
            async fn handle(&self, cx: &mut Context<'_, $db>, msg: &Message) -> Result<(), HandlerError> {
                let deposit: Deposit = msg.json()?; // not JSON: dead-lettered as `undecodable`
                if cx.message_id().as_str() == FLAKY && cx.attempt() == 1 {
                    return Err(HandlerError::transient(
                        "simulated timeout of a downstream service",
                    ));
                }
                // Not idempotent on purpose: applied twice, a balance would be wrong.
                sqlx::query($upsert)
                    .bind(&deposit.account)
                    .bind(deposit.amount)
                    .execute(cx.db())
                    .await?; // a database error is transient: rolled back, retried later
                Ok(())
            }
        }
    };
}
deposits_on!(
    Postgres,
    "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
     ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + excluded.balance"
);
deposits_on!(
    Sqlite,
    "INSERT INTO accounts (id, balance) VALUES (?1, ?2) \
     ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + excluded.balance"
);

/// What the database says happened.
struct Figures {
    applied: i64,
    conflicts: i64,
    undecodable: i64,
    flaky_attempts: i64,
    balance: i64,
    /// The conflict's dead letter holds the event's first payload: the other one was seen first.
    original_dead_lettered: bool,
}

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        // Its Display, which says what to change (a refused TLS connection names the CA or the
        // host), rather than the Debug a `main` returning the error would print.
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let postgres = postgres_flag();
    // Examples install the subscriber and the metrics recorder; the library never does.
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    for directive in txinbox::redact::LOG_DIRECTIVES {
        filter = filter.add_directive(directive.parse()?);
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal, never in a file or a log collector.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .map_err(|_| "a metrics recorder is already installed")?;

    let (broker, expected, resent) = publish();
    let (store_name, figures) = if let Some(url) = postgres {
        ("PostgreSQL", on_postgres(&broker, &url).await?)
    } else {
        ("SQLite", on_sqlite(&broker).await?)
    };

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
    let Figures {
        applied,
        conflicts,
        undecodable,
        flaky_attempts,
        balance,
        original_dead_lettered,
    } = figures;
    // Whichever of evt-7's two payloads came first was applied; the other is the dead letter.
    let (expected, evt7_applied) = if original_dead_lettered {
        (expected - deposit(7).1 + CONFLICTING_AMOUNT, "the second")
    } else {
        (expected, "the first")
    };
    let counters: HashMap<String, u64> = (snapshotter.snapshot().into_vec().into_iter())
        .filter_map(|(key, .., value)| match value {
            DebugValue::Counter(n) => Some((key.key().name().to_owned(), n)),
            _ => None,
        })
        .collect();
    let counter = |name: &str| counters.get(name).copied().unwrap_or(0);
    let skipped = counter(DUPLICATES);
    // Every delivery ends processed, skipped as a duplicate, retried later, dead-lettered, or
    // dropped unsettled by the crash (and then delivered again). A delivery whose transaction
    // committed just before the crash counts as dropped: its redelivery is a duplicate.
    let accounted = counter(PROCESSED) + skipped + retried + dead_lettered + dropped_unsettled;
    let unique = EVENTS + 1;

    println!(
        "txinbox quickstart ({store_name} inbox): {EVENTS} deposits through a faulty at-least-once broker
  published          {published:>6}  ({EVENTS} events, {resent} re-sent, 1 conflicting, 1 undecodable)
  delivered          {delivered:>6}  ({duplicates_injected} broker duplicates, {acks_lost} after a lost ack, {dropped_unsettled} after the crash, {retried} retried)
  unique events      {unique:>6}  ({EVENTS} valid, 1 undecodable)
  applied            {applied:>6}  ({FLAKY} succeeded on attempt {flaky_attempts})
  duplicates skipped {skipped:>6}  (acknowledged without running the handler)
  dead-lettered      {dead_lettered:>6}  ({conflicts} conflict, {undecodable} undecodable; {CONFLICTED}: {evt7_applied} payload was seen first and applied)
  total balance      {balance:>6}  (expected {expected})"
    );
    let mut failed = Vec::new();
    for (ok, what) in [
        (balance == expected, "total balance != expected"),
        (applied == EVENTS as i64, "applied != valid events"),
        (conflicts >= 1 && undecodable == 1, "missing dead letters"),
        (
            // A broker duplicate of a dead-lettered message is dead-lettered at the broker again.
            (conflicts + undecodable) as u64 <= dead_lettered,
            "a dead letter never reached the broker",
        ),
        (
            // Attempt 2 at the earliest; 3 when a broker duplicate claimed the event in the
            // moment between the first attempt's rollback and its failure being recorded (that
            // duplicate runs as a first attempt too, and fails the same way).
            flaky_attempts >= 2,
            "the flaky event was not retried after its transient failure",
        ),
        (accounted == delivered, "a delivery is unaccounted for"),
        (acks_lost == counter(ACK_FAILURES), "lost acks != metric"),
        (dropped_unsettled > 0, "the crash interrupted nothing"),
    ] {
        if !ok {
            failed.push(what);
        }
    }
    if !failed.is_empty() {
        eprintln!("FAILED: {}", failed.join("; "));
        std::process::exit(1);
    }
    println!("OK: every deposit applied exactly once despite duplicates, lost acks, a crash and a retry");
    Ok(())
}

/// Publishes the events; returns the broker, the expected total and how many were re-sent.
fn publish() -> (MemoryBroker, i64, usize) {
    let broker = MemoryBroker::with_seed("deposits", 42);
    broker.set_duplicate_probability(0.2);
    broker.set_lose_ack_probability(0.1);
    let (mut expected, mut resent) = (0i64, 0);
    for i in 0..EVENTS {
        let (payload, amount) = deposit(i);
        broker.publish(format!("evt-{i}"), payload.clone());
        expected += amount;
        if i % 25 == 0 {
            broker.publish(format!("evt-{i}"), payload); // a producer retry: same ID, same bytes
            resent += 1;
        }
    }
    // evt-7 again with another payload: a conflict. Only the payload the consumer sees first is
    // applied; the other is dead-lettered (`main` reads which from the dead letter).
    broker.publish(
        CONFLICTED,
        format!(r#"{{"account": "acct-7", "amount": {CONFLICTING_AMOUNT}}}"#),
    );
    broker.publish(format!("evt-{EVENTS}"), &b"\xff\xfe not json"[..]);
    broker.close(); // `run` returns once the queue is drained and everything is settled
    (broker, expected, resent)
}

/// Consumes until the queue is drained, with a crash midway: the first consumer is aborted
/// (transactions open, deliveries unsettled) and a second one takes over.
async fn consume<S>(broker: &MemoryBroker, store: S) -> Result<(), txinbox::Error>
where
    S: InboxStore + Clone,
    Deposits: Handler<S::Db>,
{
    let build = || {
        Consumer::builder(CONSUMER)
            .source(broker.source())
            .inbox(store.clone())
            .handler(Deposits)
            .concurrency(4)
            .build()
    };
    let first = tokio::spawn(build()?.run());
    while broker.stats().acked < EVENTS as u64 / 3 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    first.abort(); // the process dies: no graceful shutdown
    let _ = first.await;
    build()?.run().await
}

async fn on_sqlite(broker: &MemoryBroker) -> Result<Figures, Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("txinbox-quickstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let store = SqliteInbox::open(dir.join("inbox.db"), 4).await?;
    let pool = store.pool().clone();
    txinbox::sqlite::migrate(&pool).await?;
    sqlx::raw_sql("CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL)")
        .execute(&pool)
        .await?;
    consume(broker, store).await?;
    let (applied, conflicts, undecodable, flaky_attempts, balance, original_dead_lettered) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM txinbox_inbox WHERE consumer = ?1 AND status = 'processed'),
                (SELECT count(*) FROM txinbox_dead_letters WHERE consumer = ?1 AND reason = 'conflict'),
                (SELECT count(*) FROM txinbox_dead_letters WHERE consumer = ?1 AND reason = 'undecodable'),
                (SELECT attempts FROM txinbox_inbox WHERE consumer = ?1 AND message_id = ?2),
                (SELECT coalesce(sum(balance), 0) FROM accounts),
                (SELECT count(*) > 0 FROM txinbox_dead_letters
                 WHERE consumer = ?1 AND message_id = ?3 AND reason = 'conflict' AND payload = ?4)",
    )
    .bind(CONSUMER)
    .bind(FLAKY)
    .bind(CONFLICTED)
    .bind(deposit(7).0.into_bytes())
    .fetch_one(&pool)
    .await?;
    pool.close().await;
    std::fs::remove_dir_all(dir)?;
    Ok(Figures {
        applied,
        conflicts,
        undecodable,
        flaky_attempts,
        balance,
        original_dead_lettered,
    })
}

async fn on_postgres(broker: &MemoryBroker, url: &str) -> Result<Figures, Box<dyn std::error::Error>> {
    // `PostgresInbox::connect` checks the URL's certificate files and says what to change
    // when the server refuses the connection (an unknown CA, a certificate for another host).
    let admin = PostgresInbox::connect(url, 1).await?;
    for sql in [
        "DROP DATABASE IF EXISTS txinbox_quickstart WITH (FORCE)",
        "CREATE DATABASE txinbox_quickstart",
    ] {
        sqlx::raw_sql(sql).execute(admin.pool()).await?; // one statement each: not in a transaction
    }
    admin.pool().close().await;
    let server: PgConnectOptions = url.parse()?;
    let pool = PostgresInbox::connect_with(server.database("txinbox_quickstart"), 10)
        .await?
        .pool()
        .clone();
    txinbox::postgres::migrate(&pool).await?;
    sqlx::raw_sql("CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL)")
        .execute(&pool)
        .await?;
    consume(broker, PostgresInbox::new(pool.clone())).await?;
    let (applied, conflicts, undecodable, flaky_attempts, balance, original_dead_lettered) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM txinbox.inbox WHERE consumer = $1 AND status = 'processed'),
                (SELECT count(*) FROM txinbox.dead_letters WHERE consumer = $1 AND reason = 'conflict'),
                (SELECT count(*) FROM txinbox.dead_letters WHERE consumer = $1 AND reason = 'undecodable'),
                (SELECT attempts::bigint FROM txinbox.inbox WHERE consumer = $1 AND message_id = $2),
                (SELECT coalesce(sum(balance), 0)::bigint FROM accounts),
                EXISTS (SELECT 1 FROM txinbox.dead_letters
                        WHERE consumer = $1 AND message_id = $3 AND reason = 'conflict' AND payload = $4)",
    )
    .bind(CONSUMER)
    .bind(FLAKY)
    .bind(CONFLICTED)
    .bind(deposit(7).0.into_bytes())
    .fetch_one(&pool)
    .await?;
    Ok(Figures {
        applied,
        conflicts,
        undecodable,
        flaky_attempts,
        balance,
        original_dead_lettered,
    })
}
