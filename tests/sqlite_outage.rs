//! The SQLite inbox while its database file cannot be opened (a volume not mounted yet, a
//! directory not there): an outage by the same classification as PostgreSQL's
//! (`txinbox::store::is_unavailable`). The consumer pauses and says the database is
//! unreachable; once the file can be opened it applies every message once, on its first
//! attempt. `SQLITE_BUSY` stays a lock conflict.
#![cfg(all(feature = "sqlite", feature = "memory"))]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use sqlx::{ConnectOptions, Connection, Executor, Sqlite};
use txinbox::memory::MemoryBroker;
use txinbox::{Consumer, Context, Handler, HandlerError, Message, RetryPolicy, SqliteInbox};

/// Writes one `effects` row per message.
struct Effects;

#[txinbox::async_trait]
impl Handler<Sqlite> for Effects {
    async fn handle(&self, cx: &mut Context<'_, Sqlite>, _msg: &Message) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO effects (message_id) VALUES (?1)")
            .bind(cx.message_id().as_str())
            .execute(cx.db())
            .await?;
        Ok(())
    }
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("txinbox-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// An inbox pool on `path`, which must exist (as the application's pool would be: a missing
/// file is an outage, not a new database).
fn lazy_pool(path: &std::path::Path) -> SqlitePool {
    SqlitePoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(1))
        .connect_lazy_with(SqliteInbox::connect_options(
            SqliteConnectOptions::new()
                .filename(path)
                .create_if_missing(false),
        ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_file_that_cannot_be_opened_pauses_intake_and_counts_no_attempt() {
    let dir = scratch_dir("sqlite-outage");
    let path = dir.join("not-mounted-yet").join("inbox.db");
    let pool = lazy_pool(&path);
    let broker = MemoryBroker::new("payments");
    for i in 0..3 {
        broker.publish(format!("evt-{i}"), "{}");
    }
    let consumer = Consumer::builder("sqlite-outage")
        .source(broker.source())
        .inbox(SqliteInbox::new(pool.clone()))
        .handler(Effects)
        .concurrency(1)
        .retry_policy(RetryPolicy::default().max_attempts(1))
        .build()
        .unwrap();
    let health = consumer.health();
    let run = tokio::spawn(consumer.run());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = health.report();
        if !r.database_reachable && r.intake_paused && r.is_alive() {
            break;
        }
        assert!(
            Instant::now() < deadline && !run.is_finished(),
            "not paused for the database: {r:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !run.is_finished(),
        "the consumer stopped for an outage: {:?}",
        run.await
    );

    // The volume is there now, with the inbox migrated.
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let setup = SqlitePool::connect_with(
        SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true),
    )
    .await
    .unwrap();
    // The handler's table first: once the inbox is migrated the consumer takes messages at
    // once, and a handler that met no `effects` table would fail (dead-lettered, with
    // max_attempts 1). Seen in CI: 2 of 3 applied.
    setup
        .execute("CREATE TABLE effects (message_id TEXT NOT NULL)")
        .await
        .unwrap();
    txinbox::sqlite::migrate(&setup).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&setup)
            .await
            .unwrap();
        if n == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "{n} of 3 applied after the outage");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    broker.close();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("drains after close")
        .unwrap()
        .unwrap();
    let (effects, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT message_id) FROM effects")
            .fetch_one(&setup)
            .await
            .unwrap();
    assert_eq!((effects, distinct), (3, 3));
    let attempts: Vec<i64> =
        sqlx::query_scalar("SELECT attempts FROM txinbox_inbox WHERE consumer = 'sqlite-outage'")
            .fetch_all(&setup)
            .await
            .unwrap();
    assert_eq!(attempts, [1, 1, 1], "an outage counted as an attempt");
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM txinbox_dead_letters")
        .fetch_one(&setup)
        .await
        .unwrap();
    assert_eq!(dead, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The errors behind the test above, classified: a file that cannot be opened is unavailable;
/// `SQLITE_BUSY` (a writer holding the lock past the busy timeout) is a lock conflict, not an
/// outage; a statement's own error is neither.
#[tokio::test]
async fn sqlite_errors_are_classified_like_postgres_errors() {
    let dir = scratch_dir("sqlite-classify");
    let cannot_open = SqliteConnectOptions::new()
        .filename(dir.join("missing").join("inbox.db"))
        .connect()
        .await
        .expect_err("no such directory");
    assert!(
        txinbox::store::is_unavailable(&cannot_open) && !txinbox::store::is_lock_conflict(&cannot_open),
        "{cannot_open:?}"
    );

    let file = SqliteConnectOptions::new()
        .filename(dir.join("busy.db"))
        .create_if_missing(true)
        .busy_timeout(Duration::ZERO);
    let mut writer = file.connect().await.unwrap();
    writer.execute("CREATE TABLE t (x INTEGER)").await.unwrap();
    writer.execute("BEGIN IMMEDIATE").await.unwrap();
    let mut other = file.connect().await.unwrap();
    let busy = other.execute("BEGIN IMMEDIATE").await.expect_err("locked");
    assert!(
        txinbox::store::is_lock_conflict(&busy) && !txinbox::store::is_unavailable(&busy),
        "{busy:?}"
    );
    writer.execute("ROLLBACK").await.unwrap();
    let missing = other
        .execute("SELECT * FROM no_such_table")
        .await
        .expect_err("no such table");
    assert!(
        !txinbox::store::is_unavailable(&missing) && !txinbox::store::is_lock_conflict(&missing),
        "{missing:?}"
    );
    writer.close().await.unwrap();
    other.close().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
