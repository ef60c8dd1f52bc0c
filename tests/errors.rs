//! One error shape: every error of txinbox goes into [`txinbox::Error`] with `?`, and its cause
//! chain stays intact (`source()` leads from the `txinbox::Error` to the error raised, and on to
//! the driver's error). A store's errors name the store, and a missing table names the
//! `migrate` to run for it.
#![cfg(all(feature = "sqlite", feature = "memory"))]

use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use txinbox::memory::MemoryBroker;
use txinbox::outbox::{OutboxMessage, PublishError, Publisher, Relay, RelayConfig, RelayError};
use txinbox::source::SourceError;
use txinbox::store::StoreError;
use txinbox::{Consumer, Context, Handler, HandlerError, Message, SqliteInbox};

/// The chain under `e`, outermost first: `e` and each `source()` after it.
fn chain<'a>(e: &'a (dyn std::error::Error + 'static)) -> Vec<&'a (dyn std::error::Error + 'static)> {
    let mut out = vec![e];
    let mut at = e;
    while let Some(next) = at.source() {
        out.push(next);
        at = next;
    }
    out
}

/// Asserts that the chain of `e` holds a `T`, and after it a `C` (its cause).
#[track_caller]
fn assert_chain<T: std::error::Error + 'static, C: std::error::Error + 'static>(e: &txinbox::Error) {
    let links = chain(e);
    let texts: Vec<String> = links.iter().map(|l| l.to_string()).collect();
    let at = links
        .iter()
        .position(|l| l.is::<T>())
        .unwrap_or_else(|| panic!("no {} in the chain {texts:#?}", std::any::type_name::<T>()));
    assert!(
        links[at + 1..].iter().any(|l| l.is::<C>()),
        "no {} after the {} in the chain {texts:#?}",
        std::any::type_name::<C>(),
        std::any::type_name::<T>()
    );
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("txinbox-errors-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

struct Noop;

#[txinbox::async_trait]
impl Handler<sqlx::Sqlite> for Noop {
    async fn handle(&self, _: &mut Context<'_, sqlx::Sqlite>, _: &Message) -> Result<(), HandlerError> {
        Ok(())
    }
}

struct Nowhere;

#[txinbox::async_trait]
impl Publisher for Nowhere {
    async fn publish(&self, _: &OutboxMessage) -> Result<(), PublishError> {
        Err(PublishError::transient("nowhere to publish"))
    }
}

#[tokio::test]
async fn question_mark_turns_each_error_into_txinbox_error_with_its_causes() {
    // StoreError: the database file cannot be opened (its directory is missing).
    let dir = scratch("store");
    let store = async {
        SqliteInbox::open(dir.join("missing").join("inbox.db"), 1).await?;
        Ok::<_, txinbox::Error>(())
    };
    let e = store.await.unwrap_err();
    assert!(matches!(e, txinbox::Error::Store(_)), "{e:?}");
    assert_chain::<StoreError, sqlx::Error>(&e);
    assert!(e.to_string().contains("(SQLite)"), "names the store: {e}");

    // MigrateError: the migrations on a read-only database.
    let path = dir.join("read-only.db");
    SqliteInbox::open(&path, 1).await.unwrap();
    let pool = SqlitePoolOptions::new()
        .connect_with(SqliteConnectOptions::new().filename(&path).read_only(true))
        .await
        .unwrap();
    let migrate = async {
        txinbox::sqlite::migrate(&pool).await?;
        Ok::<_, txinbox::Error>(())
    };
    let e = migrate.await.unwrap_err();
    assert!(matches!(e, txinbox::Error::Migrate(_)), "{e:?}");
    assert_chain::<sqlx::migrate::MigrateError, sqlx::Error>(&e);

    // sqlx::Error: the application's own statement, classified and named as the store's.
    let own = async {
        sqlx::query("SELECT * FROM no_such_table").execute(&pool).await?;
        Ok::<_, txinbox::Error>(())
    };
    let e = own.await.unwrap_err();
    assert_chain::<StoreError, sqlx::Error>(&e);
    assert!(e.to_string().contains("(SQLite)"), "names the store: {e}");

    // SourceError: what an adapter's receive or constructor returns, with its driver's error.
    let source = || -> Result<(), txinbox::Error> {
        Err(SourceError::fatal(std::io::Error::other("broker said no")))?
    };
    let e = source().unwrap_err();
    assert_chain::<SourceError, std::io::Error>(&e);

    // RelayError: an invalid relay configuration (no cause of its own).
    let relay = || -> Result<(), txinbox::Error> {
        Relay::new(pool.clone(), Nowhere, RelayConfig::default().batch_size(0))?;
        Ok(())
    };
    let e = relay().unwrap_err();
    assert!(chain(&e).iter().any(|l| l.is::<RelayError>()), "{e:?}");
    assert!(e.to_string().contains("batch_size"), "{e}");

    // The consumer's own error, from `run`: the store's error and the driver's under it.
    let consume = async {
        let inbox = SqliteInbox::open(dir.join("unmigrated.db"), 2).await?;
        let broker = MemoryBroker::new("q");
        broker.publish("m-1", "{}");
        Consumer::builder("errors")
            .source(broker.source())
            .inbox(inbox)
            .handler(Noop)
            .concurrency(1)
            .build()?
            .run()
            .await?;
        Ok::<_, txinbox::Error>(())
    };
    let e = tokio::time::timeout(Duration::from_secs(30), consume)
        .await
        .expect("a missing table stops the consumer")
        .unwrap_err();
    assert_chain::<StoreError, sqlx::Error>(&e);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The SQLite store's missing table points at `txinbox::sqlite::migrate`, not PostgreSQL's.
#[tokio::test]
async fn a_missing_table_on_sqlite_says_to_run_the_sqlite_migrations() {
    let dir = scratch("unmigrated");
    let inbox = SqliteInbox::open(dir.join("inbox.db"), 2).await.unwrap();
    let broker = MemoryBroker::new("q");
    broker.publish("m-1", "{}");
    let run = Consumer::builder("unmigrated")
        .source(broker.source())
        .inbox(inbox)
        .handler(Noop)
        .concurrency(1)
        .build()
        .unwrap()
        .run();
    let e = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("a missing table stops the consumer")
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("run txinbox::sqlite::migrate") && !text.contains("postgres"),
        "{text}"
    );
    assert_eq!(broker.pending(), 1, "the message is still there");
    let _ = std::fs::remove_dir_all(&dir);
}
