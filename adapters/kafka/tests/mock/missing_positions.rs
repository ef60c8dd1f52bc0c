//! A partition the group has committed but the database has no position for (a database
//! restored from a dump taken before the partition was first processed, or a fresh database):
//! the consumer never silently starts at the group's offset (issue 15, defect 2).

use std::time::Duration;

use txinbox::sqlx;
use txinbox_kafka::{telemetry, MissingPosition};

use super::common::*;
use super::{group_offsets, metrics, setup_topic, wait_for, Mock};

/// 40 deposits (20 per partition, IDs `a-*`) processed and committed to the group; then the
/// database "restored" to a dump taken when only partition 0 had been processed (partition 1's
/// effects, inbox rows and position gone); then 20 more (`b-*`, 10 per partition).
async fn restored(name: &str) -> (Mock, String, TestDb, Published) {
    let (mock, topic) = setup_topic(name, 2);
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    let mut expected = producer.deposits(&topic, 2, "a", 40, 0).await;
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, name, &topic),
        DepositHandler::default().tagged(1),
    );
    db.wait_applied(40, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.stop().await;
    let group = group_offsets(&mock.bootstrap, name, &topic, 2);
    assert!(
        group.values().all(|o| *o == Some(20)),
        "the group committed the end: {group:?}"
    );

    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE accounts a SET balance = a.balance - s.total
         FROM (SELECT 'acct-' || ((substring(message_id from 3))::int % 7) AS account, sum(amount) AS total
               FROM effects WHERE part = 1 GROUP BY 1) s
         WHERE a.id = s.account",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(
        "DELETE FROM txinbox.inbox WHERE message_id IN (SELECT message_id FROM effects WHERE part = 1)",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query("DELETE FROM effects WHERE part = 1")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("DELETE FROM txinbox.positions WHERE source = $1 AND lane = '1'")
        .bind(&topic)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(db.applied().await, 20);
    assert_eq!(
        db.positions(&topic).await.len(),
        1,
        "only partition 0 has a position"
    );

    let more = producer.deposits(&topic, 2, "b", 20, 0).await;
    expected.amounts.extend(more.amounts);
    (mock, topic, db, expected)
}

async fn count(db: &TestDb, sql: &'static str, part: i32) -> i64 {
    sqlx::query_scalar(sql)
        .bind(part)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Default (`Refuse`): partition 0 goes on, partition 1 is held and says so; an operator's
/// position (what `txinbox positions set --to-earliest` writes) releases it without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn missing_position_refuses_by_default_until_a_position_is_written() {
    refuses_until_a_position_is_written("refuse", "range").await;
}

/// The same with incremental (cooperative-sticky) assignments.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn missing_position_refuses_until_a_position_is_written_cooperative() {
    refuses_until_a_position_is_written("refuse-coop", "cooperative-sticky").await;
}

async fn refuses_until_a_position_is_written(name: &str, strategy: &str) {
    metrics::install();
    let (mock, topic, db, expected) = restored(name).await;
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, name, &topic).set("partition.assignment.strategy", strategy),
        DepositHandler::default().tagged(2),
    );
    db.wait_applied(30, Duration::from_secs(30)).await;
    wait_for(
        Duration::from_secs(15),
        "partition 1 is reported blocked",
        || async { metrics::gauge(telemetry::PARTITIONS_BLOCKED, ("topic", &topic)) == 1.0 },
    )
    .await;
    // The held partition is not only a gauge: the consumer is not ready, and says why.
    let held = running
        .wait_health(
            Duration::from_secs(15),
            "a problem names the held partition and the cause",
            |r| {
                r.problems()
                    .iter()
                    .any(|p| p.contains(&format!("{topic}/1")) && p.contains("no position"))
            },
        )
        .await;
    assert!(!held.is_ready(), "{held:#?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        count(&db, "SELECT count(*) FROM effects WHERE part = $1", 1).await,
        0,
        "nothing of partition 1 processed while its position is missing"
    );
    assert_eq!(db.applied().await, 30, "partition 0 went on");

    sqlx::query(
        "INSERT INTO txinbox.positions (consumer, source, lane, next_position) VALUES ($1, $2, '1', 0)",
    )
    .bind(CONSUMER)
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    db.wait_applied(60, Duration::from_secs(30)).await;
    assert_eq!(
        metrics::gauge(telemetry::PARTITIONS_BLOCKED, ("topic", &topic)),
        0.0
    );
    running
        .wait_health(
            Duration::from_secs(15),
            "ready once the partition is released",
            |r| r.is_ready(),
        )
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;
    db.assert_exactly_once(&expected).await;
    assert_eq!(
        db.positions(&topic).await.values().copied().collect::<Vec<_>>(),
        [30, 30]
    );
}

/// `Earliest`: every effect the restore lost is applied again, once; nothing else twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn missing_position_earliest_reapplies_everything_lost_once() {
    let (mock, topic, db, expected) = restored("earliest").await;
    let config =
        kafka_config(&mock.bootstrap, "earliest", &topic).on_missing_position(MissingPosition::Earliest);
    let running = Running::start(&db, config, DepositHandler::default().tagged(2));
    db.wait_applied(60, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;
    db.assert_exactly_once(&expected).await;
    let run2 = "SELECT count(*) FROM effects WHERE run = 2 AND part = $1";
    assert_eq!(count(&db, run2, 1).await, 30, "partition 1: 20 lost + 10 new");
    assert_eq!(count(&db, run2, 0).await, 10, "partition 0: only the new ones");
}

/// `AdoptGroupOffset`: the group's offset counts as done (the old behaviour, now chosen).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn missing_position_adopt_starts_at_the_group_offset() {
    let (mock, topic, db, _) = restored("adopt").await;
    let config =
        kafka_config(&mock.bootstrap, "adopt", &topic).on_missing_position(MissingPosition::AdoptGroupOffset);
    let running = Running::start(&db, config, DepositHandler::default().tagged(2));
    db.wait_applied(40, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    running.stop().await;
    assert_eq!(db.applied().await, 40);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM effects WHERE part = $1 AND off < 20",
            1
        )
        .await,
        0,
        "nothing below the group's offset"
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM effects WHERE part = $1", 1).await,
        10
    );
}

/// A second consumer group under the same consumer name would share one inbox and one set of
/// positions: the source refuses to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_group_under_one_consumer_name_is_fatal() {
    let (mock, topic) = setup_topic("two-groups", 1);
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    producer.deposits(&topic, 1, "a", 5, 0).await;
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, "g-first", &topic),
        DepositHandler::default().tagged(1),
    );
    db.wait_applied(5, Duration::from_secs(30)).await;
    running.stop().await;

    let handler = DepositHandler::default().tagged(2);
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, "g-second", &topic),
        handler.clone(),
    );
    let error = running.failure(Duration::from_secs(30)).await.to_string();
    assert!(error.contains("g-first") && error.contains("g-second"), "{error}");
    assert_eq!(handler.calls(), 0);
}
