//! `KafkaConfig::ordering`: what may run at the same time within one partition, on the mock
//! cluster and a real PostgreSQL.
//!
//! One scenario per ordering: 2 partitions, 24 keys (each key on one partition), 480 records,
//! a handler that sleeps a few milliseconds and records, in memory, which keys and partitions
//! it is running at each moment and in which order each key's records start; then a restart
//! and 48 more records. Checked: no key ever runs twice at once or out of order (`Partition`,
//! `Key`); how many records of one partition ran at once (1 under `Partition`, more under
//! `Key` and `Unordered`: the test fails if the ordering has no effect); every record applied
//! exactly once across a crash and a restart, though `Key` and `Unordered` store only the
//! contiguous settled prefix with each transaction, so the restart may read records again (the
//! inbox skips them before the handler: no handler call for an applied record); once the
//! consumer is idle, and after a graceful stop, the position is exactly after the last record.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use txinbox::sqlx::{self, Postgres};
use txinbox::{async_trait, Context, Handler, HandlerError, Message};
use txinbox_kafka::{KafkaConfig, Keyless, Ordering};

use super::*;

const PARTITIONS: i32 = 2;
const KEYS: usize = 24;

/// What the handler saw.
#[derive(Default)]
struct Seen {
    /// Keys running now, with their partition.
    running: HashMap<String, i32>,
    /// Records running now, per partition.
    per_partition: HashMap<i32, usize>,
    /// The most records of one partition that ran at once.
    max_per_partition: usize,
    /// Which consumer run this is (0 before the crash, 1 after).
    run: usize,
    /// Each key's sequence numbers in the order their handler started, per run.
    starts: HashMap<(usize, String), Vec<i64>>,
    /// A key found running twice at once.
    overlaps: Vec<String>,
    /// Handler calls for a record whose effect had committed (duplicates reaching the handler).
    after_commit: usize,
}

#[derive(Clone, Default)]
struct Recording(Arc<Mutex<Seen>>);

#[derive(serde::Deserialize)]
struct Record {
    key: String,
    seq: i64,
}

#[async_trait]
impl Handler<Postgres> for Recording {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let record: Record = msg.json()?;
        let partition = msg.origin().partition.unwrap_or(-1);
        {
            let mut seen = self.0.lock().unwrap();
            if seen.running.insert(record.key.clone(), partition).is_some() {
                seen.overlaps.push(record.key.clone());
            }
            let now = {
                let n = seen.per_partition.entry(partition).or_default();
                *n += 1;
                *n
            };
            seen.max_per_partition = seen.max_per_partition.max(now);
            let run = seen.run;
            seen.starts
                .entry((run, record.key.clone()))
                .or_default()
                .push(record.seq);
        }
        // Forgets the record when the handler ends or is dropped (the crash below drops it).
        struct Running<'a>(&'a Recording, String, i32);
        impl Drop for Running<'_> {
            fn drop(&mut self) {
                let mut seen = self.0 .0.lock().unwrap();
                seen.running.remove(&self.1);
                *seen.per_partition.get_mut(&self.2).unwrap() -= 1;
            }
        }
        let _running = Running(self, record.key.clone(), partition);
        let id = cx.message_id().to_string();
        async {
            let applied: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM effects WHERE message_id = $1)")
                .bind(&id)
                .fetch_one(cx.db())
                .await?;
            if applied {
                self.0.lock().unwrap().after_commit += 1;
            }
            tokio::time::sleep(Duration::from_millis(2 + (record.seq as u64 % 4))).await;
            sqlx::query("INSERT INTO effects (message_id, amount, lane, idx, part, run) VALUES ($1, 1, $2, $3, $4, 0)")
                .bind(&id)
                .bind(&record.key)
                .bind(record.seq)
                .bind(partition)
                .execute(cx.db())
                .await?;
            Ok::<(), HandlerError>(())
        }
        .await
    }
}

/// Produces records `from..to` of the scenario: record `i` has key `k{i % KEYS}` (on partition
/// `key % PARTITIONS`), ID `o-{i}` and its key's sequence number `i / KEYS`.
async fn produce(brokers: &str, topic: &str, from: usize, to: usize) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    for i in from..to {
        let (key, id) = (format!("k{}", i % KEYS), format!("o-{i}"));
        let payload = format!(r#"{{"key":"{key}","seq":{}}}"#, i / KEYS);
        let headers = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
            key: "ce_id",
            value: Some(&id),
        });
        let record = FutureRecord::to(topic)
            .key(&key)
            .payload(&payload)
            .partition(((i % KEYS) as i32) % PARTITIONS)
            .headers(headers);
        producer.send_result(record).map_err(|(e, _)| e).unwrap();
    }
    producer.flush(Duration::from_secs(30)).unwrap();
}

fn start(
    db: &TestDb,
    config: KafkaConfig,
    handler: Recording,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), txinbox::Error>>,
) {
    let consumer = txinbox::Consumer::builder(CONSUMER)
        .source(txinbox_kafka::KafkaSource::new(config).unwrap())
        .inbox(db.inbox())
        .handler(handler)
        .concurrency(8)
        .max_in_flight(128)
        .build()
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    (
        stop,
        tokio::spawn(consumer.run_until(async {
            let _ = stopped.await;
        })),
    )
}

async fn stop(
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), txinbox::Error>>,
) {
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// Runs the scenario under `ordering`; returns what the handler saw.
async fn scenario(ordering: Ordering, name: &str) -> Seen {
    let (mock, topic) = setup_topic(name, PARTITIONS);
    let db = TestDb::new().await;
    let first = KEYS * 20;
    produce(&mock.bootstrap, &topic, 0, first).await;
    let config = || kafka_config(&mock.bootstrap, &format!("g-{name}"), &topic).ordering(ordering);
    let handler = Recording::default();

    let (s, task) = start(&db, config(), handler.clone());
    db.wait_applied(first as i64 / 2, Duration::from_secs(60)).await;
    // A crash mid-stream: the consumer's future dropped, nothing closed, transactions in
    // flight rolled back. The positions stored with the last transactions may trail what they
    // applied, never pass what they did not: a position stored past a record not yet
    // committed would make the restart skip it.
    task.abort();
    let _ = task.await;
    drop(s);
    let positions = db.positions(&topic).await;
    for (partition, next) in &positions {
        assert!(
            *next <= (first / PARTITIONS as usize) as i64,
            "partition {partition}: position {next} is past the end of the partition"
        );
    }

    // A restart: from the database positions; what was applied past them is read again and
    // skipped as duplicates.
    let more = KEYS * 2;
    produce(&mock.bootstrap, &topic, first, first + more).await;
    handler.0.lock().unwrap().run = 1;
    let (s, task) = start(&db, config(), handler.clone());
    db.wait_applied((first + more) as i64, Duration::from_secs(60))
        .await;
    // Idle and still running: the database positions reach the end of each partition (under
    // key and unordered ordering the source stores the settled prefix of a quiet partition;
    // the last transactions' own prefixes may trail). What operators and lag checks read.
    let end = ((first + more) / PARTITIONS as usize) as i64;
    wait_for(
        Duration::from_secs(15),
        "the database positions of an idle consumer reach the partitions' ends",
        || async {
            let positions = db.positions(&topic).await;
            positions.len() == PARTITIONS as usize && positions.values().all(|n| *n == end)
        },
    )
    .await;
    stop(s, task).await;

    let applications = db.applications().await;
    assert_eq!(applications.len(), first + more, "every record applied");
    let twice: Vec<_> = applications.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "{ordering}: applied more than once: {twice:?}");
    for (partition, next) in db.positions(&topic).await {
        assert_eq!(
            next, end,
            "{ordering}: partition {partition}'s position after a graceful stop: after its last record"
        );
    }
    let seen = std::mem::take(&mut *handler.0.lock().unwrap());
    assert_eq!(
        seen.after_commit, 0,
        "{ordering}: a record applied before reached the handler again"
    );
    db.drop_db().await;
    drop(mock);
    seen
}

/// Within each run, each key's records started in offset order, each once (nothing fails
/// here); the restart goes on from a record at or before where the crash stopped the key
/// (what the crash rolled back runs again, what committed does not: the scenario checks that).
fn assert_in_order_per_key(ordering: Ordering, seen: &Seen) {
    assert!(
        seen.overlaps.is_empty(),
        "{ordering}: keys ran twice at once: {:?}",
        seen.overlaps
    );
    for k in 0..KEYS {
        let key = format!("k{k}");
        let runs: Vec<&[i64]> = (0..2)
            .map(|run| seen.starts.get(&(run, key.clone())).map_or(&[][..], |v| &v[..]))
            .collect();
        for (run, seqs) in runs.iter().enumerate() {
            assert!(
                seqs.windows(2).all(|w| w[0] < w[1]),
                "{ordering}: run {run}: key {key}'s records started out of order: {seqs:?}"
            );
        }
        let resumed = runs[1].first().copied().unwrap_or(22);
        let reached = runs[0].last().map_or(0, |last| last + 1);
        assert!(
            resumed <= reached,
            "{ordering}: key {key} resumed at {resumed} after the crash, past {reached}: records skipped"
        );
        assert_eq!(
            runs[1].last(),
            Some(&21),
            "{ordering}: key {key}'s last record ran after the restart"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partition_ordering_runs_one_record_of_a_partition_at_a_time() {
    let seen = scenario(Ordering::Partition, "order-partition").await;
    assert_in_order_per_key(Ordering::Partition, &seen);
    assert_eq!(
        seen.max_per_partition, 1,
        "records of one partition ran side by side under partition ordering"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn key_ordering_runs_the_keys_of_a_partition_side_by_side_each_key_in_order() {
    let seen = scenario(Ordering::Key(Keyless::InOrder), "order-key").await;
    assert_in_order_per_key(Ordering::Key(Keyless::InOrder), &seen);
    assert!(
        seen.max_per_partition >= 3,
        "under key ordering at most {} records of one partition ran at once (12 keys per partition, concurrency 8)",
        seen.max_per_partition
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unordered_runs_records_of_a_partition_side_by_side_and_applies_each_once() {
    let seen = scenario(Ordering::Unordered, "order-none").await;
    assert!(
        seen.max_per_partition >= 3,
        "unordered: at most {} records of one partition ran at once",
        seen.max_per_partition
    );
}
