//! How the consumer reads its database's health: an overloaded pool is backpressure, not an
//! outage; a handler cannot ask to be retried after a day; settings that break durability
//! are reported when the consumer starts.

use std::time::Duration;

use txinbox::memory::MemoryBroker;
use txinbox::{Consumer, Error, HandlerError};

use super::metrics::{counter, snapshotter};
use super::spans::{capture, warnings_of};
use super::support::{deposit_in_lane, drain, DepositHandler, TestDb};

/// A consumer `name` on a pool of 2 whose connections the test holds (returned: drop them to
/// free the pool), with one deposit to apply.
async fn saturated(
    name: &str,
    db: &TestDb,
) -> (
    Vec<sqlx::pool::PoolConnection<sqlx::Postgres>>,
    tokio::task::JoinHandle<Result<(), Error>>,
) {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(200))
        .connect_with((*db.pool.connect_options()).clone())
        .await
        .unwrap();
    let held = vec![pool.acquire().await.unwrap(), pool.acquire().await.unwrap()];
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
    broker.close();
    let consumer = Consumer::builder(name)
        .source(broker.source())
        .inbox(txinbox::PostgresInbox::new(pool.clone()))
        .handler(DepositHandler::default())
        .concurrency(2)
        .build()
        .unwrap();
    let run = tokio::spawn(consumer.run());
    (held, run)
}

/// Every connection of the pool is busy (here: held by the test, as other work in the
/// application would hold them) for longer than the acquire timeout. The database is fine, so
/// this must not be counted or logged as an outage (it used to be: `PoolTimedOut` was
/// "unavailable", which pauses intake and raises `txinbox_store_errors_total`, what operators
/// alert on).
#[tokio::test]
async fn a_saturated_pool_is_backpressure_not_an_outage() {
    snapshotter();
    let db = TestDb::new(10).await;
    let (held, run) = saturated("saturated", &db).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    drop(held);
    tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("finishes once connections are free")
        .unwrap()
        .unwrap();
    assert_eq!(db.balance("alice").await, 10);
    assert_eq!(
        counter(txinbox::telemetry::STORE_ERRORS, "saturated", None),
        0,
        "a busy pool is not an outage"
    );
}

/// A pool that stays saturated is what a server that stopped answering looks like from here
/// (every connection stuck in its transaction until TCP gives up): after some tries it is
/// reported as an outage, so intake pauses and the store-error alert fires.
#[tokio::test]
async fn a_pool_saturated_for_long_is_reported_as_an_outage() {
    snapshotter();
    let db = TestDb::new(10).await;
    let (held, run) = saturated("saturated-long", &db).await;
    let started = std::time::Instant::now();
    while counter(txinbox::telemetry::STORE_ERRORS, "saturated-long", None) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "a pool saturated for 30 s is still not reported"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(held);
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("finishes once connections are free")
        .unwrap()
        .unwrap();
    assert_eq!(db.balance("alice").await, 10, "and nothing was lost");
}

/// A handler asking for a retry a day later (a rate limiter's `Retry-After`, a bug) is retried
/// after at most `max_delay`; before, the message (and with Kafka its whole partition) waited
/// the full day.
#[tokio::test]
async fn a_requested_retry_delay_is_capped_at_max_delay() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
    broker.close();
    let handler = DepositHandler::failing(|_, attempt| {
        (attempt == 1)
            .then(|| HandlerError::transient("rate limited").retry_after(Duration::from_secs(86_400)))
    });
    let run = drain("capped-retry", &db, &broker, handler);
    tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("retried long before a day");
    assert_eq!(db.balance("alice").await, 10);
}

/// `synchronous_commit = off` lets PostgreSQL acknowledge a COMMIT before it is durable: a
/// crash then loses messages the broker was told were done. The consumer says so at start.
#[tokio::test]
async fn synchronous_commit_off_is_reported_at_start() {
    capture();
    let db = TestDb::new(10).await;
    let options = (*db.pool.connect_options())
        .clone()
        .options([("synchronous_commit", "off")]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .unwrap();
    for (name, pool) in [("async-commit", pool), ("sync-commit", db.pool.clone())] {
        let broker = MemoryBroker::new("payments");
        broker.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
        broker.close();
        Consumer::builder(name)
            .source(broker.source())
            .inbox(txinbox::PostgresInbox::new(pool))
            .handler(DepositHandler::default())
            .build()
            .unwrap()
            .run()
            .await
            .unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while warnings_of("async-commit").is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let warnings = warnings_of("async-commit");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0]["warning"].contains("synchronous_commit is off"),
        "{warnings:?}"
    );
    assert!(
        warnings_of("sync-commit").is_empty(),
        "{:?}",
        warnings_of("sync-commit")
    );
}

/// Connection strings reach errors and `Debug` output only without their password.
#[tokio::test]
async fn connection_errors_and_debug_output_never_show_the_password() {
    const SECRET: &str = "S3cr3t-canary";
    let mut urls = vec![
        // Nothing listens there (sqlx retries a refused connection until the acquire timeout,
        // so only one of these).
        format!("postgres://app:{SECRET}@127.0.0.1:1/app"),
    ];
    for pw in ["", "/with/slashes", "?q=1", "#frag", "@at@"] {
        let pw = format!("{SECRET}{pw}");
        // Does not parse.
        urls.push(format!("postgres://app:{pw}@127.0.0.1:notaport/app"));
        urls.push(format!("postgres://app@127.0.0.1:notaport/app?password={pw}"));
    }
    {
        for url in urls {
            let e = txinbox::PostgresInbox::connect(&url, 1).await.unwrap_err();
            for shown in [e.to_string(), format!("{e:?}"), txinbox::redact::url(&url)] {
                assert!(!shown.contains(SECRET), "{shown}");
            }
        }
    }
    let db = TestDb::new(2).await;
    let shown = format!("{:?}", db.inbox());
    assert!(!shown.contains("password"), "{shown}");
}
