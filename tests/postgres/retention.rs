//! The consumer's own retention (`ConsumerBuilder::retention`): what it deletes and keeps, the
//! guard on the window, and that it commits batch by batch and stops with the consumer.

use std::time::{Duration, Instant};

use txinbox::consumer::Retention;
use txinbox::janitor::Schedule;
use txinbox::memory::MemoryBroker;
use txinbox::{Consumer, Error};

use super::metrics::{counter, snapshotter};
use super::support::{drain, DepositHandler, TestDb};
use txinbox_testing::ledger::deposit;

const DAY: Duration = Duration::from_secs(24 * 3600);

/// Inserts `n` terminal rows of `consumer` that finished `days_ago`, `<prefix>-<i>`.
async fn aged_rows(db: &TestDb, consumer: &str, prefix: &str, n: i64, days_ago: i64) {
    sqlx::query(
        "INSERT INTO txinbox.inbox (consumer, message_id, id_strategy, fingerprint, status, attempts, processed_at, source_system, destination)
         SELECT $1, $2 || '-' || g, 'native', decode(repeat('00', 32), 'hex'), 'processed', 1,
                now() - make_interval(days => $4::int), 'memory', 'payments'
         FROM generate_series(1, $3::bigint) g",
    )
    .bind(consumer)
    .bind(prefix)
    .bind(n)
    .bind(days_ago as i32)
    .execute(&db.pool)
    .await
    .unwrap();
}

async fn rows_like(db: &TestDb, consumer: &str, pattern: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM txinbox.inbox WHERE consumer = $1 AND message_id LIKE $2")
        .bind(consumer)
        .bind(pattern)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Waits (up to 30 s) until `done` holds.
async fn until<F: std::future::Future<Output = bool>>(mut done: impl FnMut() -> F) {
    let started = Instant::now();
    while !done().await {
        assert!(started.elapsed() < Duration::from_secs(30), "timed out");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Old rows go, recent ones stay, and so do the rows `txinbox purge` keeps (`retrying`, at or
/// after a stored position); a redelivery of a message whose row was kept is still a
/// duplicate. Counted in `txinbox_retention_deleted_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_old_rows_keeps_the_rest_and_kept_rows_still_deduplicate() {
    snapshotter();
    let db = TestDb::new(10).await;
    let name = "retained";
    // Recent rows through the consumer itself: their deposits are applied once.
    let broker = MemoryBroker::new("payments");
    for i in 0..10 {
        broker.publish(format!("new-{i}"), deposit("alice", 1));
    }
    broker.close();
    drain(name, &db, &broker, DepositHandler::default()).await;
    assert_eq!(db.balance("alice").await, 10);
    aged_rows(&db, name, "old", 250, 10).await;
    // Old, but at or after the stored position of its partition: a restart re-reads it.
    aged_rows(&db, name, "pinned", 3, 10).await;
    sqlx::raw_sql(
        "UPDATE txinbox.inbox SET source_partition = 0, source_offset = 40 + length(message_id)
             WHERE message_id LIKE 'pinned-%';
         INSERT INTO txinbox.positions (consumer, source, lane, next_position)
             VALUES ('retained', 'payments', '0', 40);
         UPDATE txinbox.inbox SET status = 'retrying' WHERE consumer = 'retained' AND message_id = 'old-1';",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    // The consumer with retention, and a redelivery of a recent message.
    let broker = MemoryBroker::new("payments");
    broker.publish("new-3", deposit("alice", 1));
    let consumer = Consumer::builder(name)
        .source(broker.source())
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .retention(Retention::new(8 * DAY).schedule(Schedule {
            batch: 40,
            pause: Duration::from_millis(1),
            ..Schedule::default()
        }))
        .build()
        .unwrap();
    let pool = db.pool.clone();
    consumer
        .run_until(async move {
            // Until the purge is done and the redelivery settled.
            let old = || async {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM txinbox.inbox WHERE consumer = 'retained' AND message_id LIKE 'old-%'",
                )
                .fetch_one(&pool)
                .await
                .unwrap()
                    == 1
            };
            until(old).await;
            until(|| async { broker.pending() == 0 && broker.stats().acked == 1 }).await;
        })
        .await
        .unwrap();

    assert_eq!(rows_like(&db, name, "new-%").await, 10, "recent rows are kept");
    assert_eq!(
        rows_like(&db, name, "old-%").await,
        1,
        "only the retrying one is kept"
    );
    assert_eq!(
        rows_like(&db, name, "pinned-%").await,
        3,
        "rows at or after a stored position are kept"
    );
    assert_eq!(
        db.balance("alice").await,
        10,
        "the redelivered message's row was kept: a duplicate, not applied again"
    );
    assert_eq!(counter(txinbox::telemetry::DUPLICATES, name, None), 1);
    assert_eq!(
        counter(
            txinbox::telemetry::RETENTION_DELETED,
            name,
            Some(("table", "inbox"))
        ),
        249
    );
    let horizon = txinbox::ops::retention::horizon(&db.pool, name).await.unwrap();
    assert!(
        horizon.is_some(),
        "the horizon is recorded, so replay knows what is gone"
    );
}

/// The guard `txinbox purge` applies: a window inside the dedup window (7 days) is refused
/// unless forced; a store of its own cannot be purged by txinbox.
#[tokio::test]
async fn a_window_inside_the_dedup_window_is_refused_unless_forced() {
    let db = TestDb::new(4).await;
    let build = |retention: Retention| {
        Consumer::builder("guarded")
            .source(MemoryBroker::new("payments").source())
            .inbox(db.inbox())
            .handler(DepositHandler::default())
            .concurrency(2)
            .retention(retention)
            .build()
    };
    match build(Retention::new(Duration::from_secs(3600))) {
        Err(Error::Config(e)) => {
            assert!(e.contains("inside the dedup window (7d)"), "{e}");
            assert!(e.contains("Retention::force"), "says how: {e}");
        }
        other => panic!("a 1h window must be refused: {other:?}"),
    }
    build(Retention::new(Duration::from_secs(3600)).force()).expect("forced");
    build(Retention::new(7 * DAY).broker_retention(14 * DAY)).expect("shorter than the broker's: a warning");
    build(Retention::new(7 * DAY).schedule(Schedule {
        batch: 0,
        ..Schedule::default()
    }))
    .expect_err("a batch of 0 rows");
}

/// Each batch commits on its own (an observer sees the count fall step by step, and the
/// janitor's session is never idle inside a transaction), and the janitor stops with the
/// consumer: in the middle of a pass, nothing more is deleted once `run_until` returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_commits_batch_by_batch_and_stops_with_the_consumer() {
    let db = TestDb::new(6).await;
    let name = "stopping";
    let total = 3_000;
    aged_rows(&db, name, "old", total, 30).await;
    let broker = MemoryBroker::new("payments");
    let consumer = Consumer::builder(name)
        .source(broker.source())
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .concurrency(2)
        .retention(Retention::new(8 * DAY).schedule(Schedule {
            batch: 100,
            pause: Duration::from_millis(150),
            interval: Duration::from_secs(3600),
        }))
        .build()
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));

    let mut seen = Vec::new();
    let mut idle_in_transaction = 0;
    let started = Instant::now();
    loop {
        let left = rows_like(&db, name, "old-%").await;
        if seen.last() != Some(&left) {
            seen.push(left);
        }
        idle_in_transaction += db
            .scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND state = 'idle in transaction'
                   AND state_change < now() - interval '100 milliseconds'",
            )
            .await;
        if left <= total - 500 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no progress: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        seen.len() >= 4 && seen.iter().all(|n| (total - n) % 100 == 0),
        "the count falls one committed batch of 100 at a time: {seen:?}"
    );
    assert_eq!(
        idle_in_transaction, 0,
        "no transaction is held open between statements or batches"
    );

    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .expect("run_until returns promptly: the janitor stops in its pause")
        .unwrap()
        .unwrap();
    let at_stop = rows_like(&db, name, "old-%").await;
    assert!(at_stop > 0, "stopped mid-pass");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        rows_like(&db, name, "old-%").await,
        at_stop,
        "nothing is deleted once the consumer stopped"
    );
}

/// A pass with nothing to delete leaves the retention horizon where it was, as `txinbox purge`
/// does: moved on every pass, it refused every `txinbox positions set/adopt` whose
/// confirmation spanned a pass ("a purge moved the retention horizon while the plan was
/// made"). And the guard holds on the janitor's own constructor, not only on the builder.
#[tokio::test]
async fn a_pass_with_nothing_to_delete_leaves_the_horizon_and_the_guard_holds_on_the_sweep() {
    use txinbox::janitor::Janitor;
    use txinbox::ops::{retention::InboxSweep, DbPool};
    let db = TestDb::new(4).await;
    let name = "idle-janitor";
    aged_rows(&db, name, "recent", 5, 1).await;
    let pool = DbPool::Postgres(db.pool.clone());
    assert!(
        InboxSweep::new(pool.clone(), name, DAY).is_err(),
        "a one-day window is inside the dedup window"
    );
    let sweep = InboxSweep::new(pool.clone(), name, 7 * DAY).unwrap();
    let janitor = Janitor::new(sweep, Schedule::default(), "inbox", Some(("consumer", name))).unwrap();
    assert_eq!(janitor.pass().await.unwrap(), 0);
    let horizon = txinbox::ops::retention::horizon(&db.pool, name).await.unwrap();
    assert!(horizon.is_none(), "nothing was deleted: no horizon ({horizon:?})");
    aged_rows(&db, name, "old", 3, 8).await;
    assert_eq!(janitor.pass().await.unwrap(), 3);
    let horizon = txinbox::ops::retention::horizon(&db.pool, name).await.unwrap();
    assert!(horizon.is_some(), "a pass that deletes records the horizon first");
    assert_eq!(rows_like(&db, name, "recent-%").await, 5);
}
