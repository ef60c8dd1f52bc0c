//! A database position behind the broker's retention (issue 26, item 5): records after the
//! position were deleted before the consumer processed them. Seeking there would be answered by
//! `auto.offset.reset` without a word; the consumer compares the position with the low
//! watermark on assignment and never resolves a gap silently. And a group offset of exactly 0
//! is an offset, not the absence of one.
//!
//! librdkafka's mock cluster keeps at most 5 MB per partition and deletes the oldest record
//! batches beyond that: real retention (by size), which moves the low watermark. (The mock has
//! no DeleteRecords; tansu's retention is not something a test can trigger.)

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use txinbox::sqlx;
use txinbox_kafka::{telemetry, RetentionGap};

use super::common::*;
use super::{metrics, setup_topic, wait_for, Mock};

/// Records in the topic before the consumer's restart: 5 small, 30 large, 3 small.
const TOTAL: i64 = 38;

fn low_watermark(brokers: &str, topic: &str) -> i64 {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    c.fetch_watermarks(topic, 0, Duration::from_secs(10))
        .expect("watermarks")
        .0
}

/// 5 deposits processed by a consumer (database position 5), which then stops; 30 deposits of
/// about 200 KB follow, more than the mock cluster keeps, so retention deletes the oldest
/// batches and the low watermark passes 5: offsets 5..low are gone unprocessed; then 3 small
/// deposits. Returns the low watermark.
async fn behind_retention(name: &str) -> (Mock, String, TestDb, i64) {
    let (mock, topic) = setup_topic(name, 1);
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    producer.deposits(&topic, 1, "a", 5, 0).await;
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, name, &topic),
        DepositHandler::default().tagged(1),
    );
    db.wait_applied(5, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.stop().await;
    assert_eq!(db.positions(&topic).await.get(&0), Some(&5));

    let pad = "x".repeat(200_000);
    for i in 0..30 {
        let id = format!("big-{i}");
        let payload = format!(r#"{{"account":"acct-1","amount":1,"pad":"{pad}"}}"#);
        producer.send(&topic, Some(0), &id, Some(&id), &payload).await;
    }
    for i in 0..3 {
        let id = format!("b-{i}");
        producer
            .send(&topic, Some(0), &id, Some(&id), &deposit("acct-2", 1))
            .await;
    }
    let low = low_watermark(&mock.bootstrap, &topic);
    assert!(
        (6..TOTAL).contains(&low),
        "retention deleted records after the database position: low watermark {low}"
    );
    (mock, topic, db, low)
}

async fn offsets_of_run(db: &TestDb, run: i32) -> Vec<i64> {
    sqlx::query_scalar("SELECT off FROM effects WHERE run = $1 ORDER BY off")
        .bind(run)
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// Default: the partition is held; an ERROR, the counter and the health report name the
/// partition, the position, the low watermark and the number of offsets lost; nothing is
/// consumed. Writing another position (what `txinbox positions set --to-earliest` writes: the
/// low watermark) releases it within seconds, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_position_behind_retention_is_held_and_reported_until_the_gap_is_accepted() {
    metrics::install();
    let (mock, topic, db, low) = behind_retention("retention-refuse").await;
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, "retention-refuse", &topic),
        DepositHandler::default().tagged(2),
    );
    let lost = low - 5;
    let held = running
        .wait_health(
            Duration::from_secs(30),
            "a problem names partition, position, low watermark and what was lost",
            |r| {
                r.problems().iter().any(|p| {
                    p.contains(&format!("{topic}/0"))
                        && p.contains(&format!(
                            "database position 5 is behind the broker's low watermark {low}"
                        ))
                        && p.contains(&format!("deleted {lost} records"))
                })
            },
        )
        .await;
    assert!(!held.is_ready(), "{held:#?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(db.applied().await, 5, "nothing consumed while held");
    assert!(
        metrics::counter(telemetry::OFFSETS_DELETED_UNPROCESSED, ("topic", &topic)) >= lost as u64,
        "the lost offsets are counted"
    );
    assert_eq!(
        metrics::gauge(telemetry::PARTITIONS_BLOCKED, ("topic", &topic)),
        1.0
    );

    sqlx::query(
        "UPDATE txinbox.positions SET next_position = $3 WHERE consumer = $1 AND source = $2 AND lane = '0'",
    )
    .bind(CONSUMER)
    .bind(&topic)
    .bind(low)
    .execute(&db.pool)
    .await
    .unwrap();
    db.wait_applied(5 + TOTAL - low, Duration::from_secs(30)).await;
    running
        .wait_health(Duration::from_secs(15), "ready once the gap is accepted", |r| {
            r.is_ready()
        })
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;
    assert_eq!(
        offsets_of_run(&db, 2).await,
        (low..TOTAL).collect::<Vec<_>>(),
        "everything retained, from the low watermark, once"
    );
    assert_eq!(
        metrics::gauge(telemetry::PARTITIONS_BLOCKED, ("topic", &topic)),
        0.0
    );
}

/// `RetentionGap::Earliest`: the gap is accepted on purpose: the partition starts at the
/// earliest retained offset, the consumer stays ready, and the gap is still counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retention_gap_earliest_starts_at_the_low_watermark_and_counts_the_gap() {
    metrics::install();
    let (mock, topic, db, low) = behind_retention("retention-earliest").await;
    let config =
        kafka_config(&mock.bootstrap, "retention-earliest", &topic).on_retention_gap(RetentionGap::Earliest);
    let running = Running::start(&db, config, DepositHandler::default().tagged(2));
    db.wait_applied(5 + TOTAL - low, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = running.health.report();
    assert!(report.is_ready(), "{:?}", report.problems());
    running.stop().await;
    assert_eq!(offsets_of_run(&db, 2).await, (low..TOTAL).collect::<Vec<_>>());
    assert!(metrics::counter(telemetry::OFFSETS_DELETED_UNPROCESSED, ("topic", &topic)) >= (low - 5) as u64);
}

/// A group that committed offset 0 is at the start of the partition: a partition without a
/// database position starts there, not at `auto.offset.reset` (here `latest`, which would skip
/// every record before the consumer joined).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_committed_group_offset_of_zero_is_an_offset() {
    let (mock, topic) = setup_topic("group-offset-zero", 1);
    let db = TestDb::new().await;
    let published = Producer::new(&mock.bootstrap)
        .deposits(&topic, 1, "z", 5, 0)
        .await;
    {
        let group: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &mock.bootstrap)
            .set("group.id", "g-zero")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, 0, Offset::Offset(0)).unwrap();
        group.commit(&tpl, CommitMode::Sync).expect("commit offset 0");
    }
    assert_eq!(
        super::group_offsets(&mock.bootstrap, "g-zero", &topic, 1)[&0],
        Some(0)
    );
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, "g-zero", &topic).set("auto.offset.reset", "latest"),
        DepositHandler::default().tagged(1),
    );
    wait_for(
        Duration::from_secs(30),
        "every record from the group's offset 0 applied",
        || async { db.applied().await == published.amounts.len() as i64 },
    )
    .await;
    running.stop().await;
}
