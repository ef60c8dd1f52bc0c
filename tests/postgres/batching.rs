//! Micro-batching: several messages of a lane in one transaction, with the same outcomes as
//! one at a time. Each test publishes before the consumer starts and sets a linger, so the
//! lane's messages are claimed as one batch; `batch_effects.txid` shows which messages
//! shared a transaction.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::Postgres;
use txinbox::memory::MemoryBroker;
use txinbox::{
    dead_letter::DeadLetterReason, handler::BatchContext, handler::BatchHandler, handler::BatchMessage,
    Consumer, Context, Handler, HandlerError, Message,
};

use super::support::{fast_retries, TestDb};

type FailFn = dyn Fn(&Message, u32) -> Option<HandlerError> + Send + Sync;

/// Writes one `batch_effects` row (with its transaction ID) per message, then fails if
/// `fail` says so: a failing message always leaves a partial effect in its transaction.
#[derive(Clone)]
struct Recording {
    fail: Arc<FailFn>,
    /// IDs whose handler ignores a failed statement on attempt 1.
    swallow: Option<&'static str>,
    block_on: Option<&'static str>,
    entered: Arc<tokio::sync::Notify>,
    calls: Arc<AtomicUsize>,
}

impl Recording {
    fn new() -> Self {
        Recording {
            fail: Arc::new(|_, _| None),
            swallow: None,
            block_on: None,
            entered: Arc::default(),
            calls: Arc::default(),
        }
    }
    fn failing(f: impl Fn(&Message, u32) -> Option<HandlerError> + Send + Sync + 'static) -> Self {
        Recording {
            fail: Arc::new(f),
            ..Self::new()
        }
    }
}

async fn record(conn: &mut sqlx::PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO batch_effects (message_id, txid) VALUES ($1, txid_current())")
        .bind(id)
        .execute(conn)
        .await
        .map(drop)
}

#[txinbox::async_trait]
impl Handler<Postgres> for Recording {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let id = cx.message_id().to_string();
        record(cx.db(), &id).await?;
        if self.swallow == Some(id.as_str()) && cx.attempt() == 1 {
            let _ = sqlx::query("SELECT 1 / 0").execute(cx.db()).await; // error ignored
        }
        if self.block_on == Some(id.as_str()) {
            self.entered.notify_one();
            std::future::pending::<()>().await;
        }
        match (self.fail)(msg, cx.attempt()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

async fn db() -> TestDb {
    let db = TestDb::new(10).await;
    sqlx::raw_sql(
        "CREATE TABLE batch_effects (seq bigserial PRIMARY KEY, message_id text NOT NULL, txid bigint NOT NULL)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    db
}

/// Message ID → (effect rows, transaction IDs).
async fn effects(db: &TestDb) -> HashMap<String, (usize, Vec<i64>)> {
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT message_id, txid FROM batch_effects ORDER BY seq")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let mut map: HashMap<String, (usize, Vec<i64>)> = HashMap::new();
    for (id, txid) in rows {
        let e = map.entry(id).or_default();
        e.0 += 1;
        e.1.push(txid);
    }
    map
}

fn consumer<H: Handler<Postgres>>(
    name: &str,
    db: &TestDb,
    broker: &MemoryBroker,
    handler: H,
) -> Consumer<txinbox::memory::MemorySource, txinbox::PostgresInbox, H> {
    Consumer::builder(name)
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler)
        .retry_policy(fast_retries().max_attempts(3))
        .batch_linger(Duration::from_millis(300))
        .build()
        .unwrap()
}

/// On the shared queue of unordered deliveries, while a transaction runs, the next one
/// starts with a full batch, or after a short wait with what is queued: one transaction of
/// ten messages, not ten of one (several small concurrent transactions cost the database,
/// and the CPU it shares with the broker, far more per message), and never held behind a
/// transaction that does not end. Under load the queue fills and they all run.
#[tokio::test(flavor = "multi_thread")]
async fn unordered_messages_wait_briefly_for_a_full_batch_while_a_transaction_runs() {
    let db = db().await;
    let broker = MemoryBroker::new("batch");
    let mut handler = Recording::new();
    handler.block_on = Some("first");
    let (calls, entered) = (handler.calls.clone(), handler.entered.clone());
    let consumer = Consumer::builder("fullbatch")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler)
        .batch_size(20)
        .build()
        .unwrap();
    let running = tokio::spawn(consumer.run());
    broker.publish("first", "blocks its transaction");
    tokio::time::timeout(Duration::from_secs(10), entered.notified())
        .await
        .expect("the first message's handler runs");
    for i in 0..10 {
        broker.publish(format!("m{i}"), "p");
    }
    let wait_for = |n: usize, what: &'static str| {
        let calls = calls.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while calls.load(Ordering::SeqCst) < n {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{what}: {} calls",
                    calls.load(Ordering::SeqCst)
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait_for(11, "the queued messages do not wait for the blocked transaction").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let fx = loop {
        let fx = effects(&db).await;
        if fx.len() == 10 || tokio::time::Instant::now() > deadline {
            break fx;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let txids: std::collections::HashSet<i64> = fx.values().flat_map(|(_, t)| t.clone()).collect();
    assert_eq!(
        (fx.len(), txids.len()),
        (10, 1),
        "the 10 messages queued behind a running transaction commit as one: {fx:?}"
    );
    for i in 10..50 {
        broker.publish(format!("m{i}"), "p");
    }
    wait_for(
        51,
        "with full batches queued, more transactions start beside the blocked one",
    )
    .await;
    running.abort();
}

#[tokio::test]
async fn a_failing_message_mid_batch_never_loses_or_duplicates_its_neighbours() {
    let db = db().await;
    let broker = MemoryBroker::new("batch");
    for i in 0..8 {
        broker.publish_in_lane("l", format!("m{i}"), format!("payload {i}"));
    }
    broker.close();
    let handler = Recording::failing(|m, attempt| match m.native_id() {
        Some("m2") => Some(HandlerError::permanent("poison")),
        Some("m5") if attempt == 1 => Some(HandlerError::transient("flaky once")),
        _ => None,
    });
    consumer("midfail", &db, &broker, handler).run().await.unwrap();

    let fx = effects(&db).await;
    for i in [0, 1, 3, 4, 5, 6, 7] {
        assert_eq!(fx[&format!("m{i}")].0, 1, "m{i} applied exactly once: {fx:?}");
    }
    assert!(
        !fx.contains_key("m2"),
        "no partial effect of the failing message committed"
    );
    assert_eq!(
        fx["m0"].1, fx["m1"].1,
        "the messages before the failure committed as one batch"
    );
    let (reason, attempts): (String, i32) =
        sqlx::query_as("SELECT reason, attempts FROM txinbox.dead_letters WHERE message_id = 'm2'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((reason.as_str(), attempts), ("permanent_error", 1));
    let m5: (String, i32) =
        sqlx::query_as("SELECT status, attempts FROM txinbox.inbox WHERE message_id = 'm5'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(m5, ("processed".to_string(), 2), "m5 retried once, counted once");
    let stats = broker.stats();
    assert_eq!((stats.acked, stats.dead_lettered, stats.retried), (7, 1, 1));
}

#[tokio::test]
async fn repeats_of_an_id_inside_a_batch_are_duplicates_or_conflicts() {
    let db = db().await;
    let broker = MemoryBroker::new("batch");
    broker.publish_in_lane("l", "a", "pa");
    broker.publish_in_lane("l", "b", "pb");
    broker.publish_in_lane("l", "a", "pa"); // the same ID twice in one batch
    broker.publish_in_lane("l", "c", "pc");
    broker.publish_in_lane("l", "a", "pa"); // and a third time
    broker.publish_in_lane("l", "b", "pb-other"); // same ID, other payload: a conflict
    broker.publish_in_lane("l", "d", "pd");
    broker.close();
    consumer("repeats", &db, &broker, Recording::new())
        .run()
        .await
        .expect("repeated IDs never fail the batch statement");

    let fx = effects(&db).await;
    for id in ["a", "b", "c", "d"] {
        assert_eq!(fx[id].0, 1, "{id} applied exactly once: {fx:?}");
    }
    assert!(
        fx["a"].1 == fx["b"].1 && fx["b"].1 == fx["c"].1,
        "a, b and c shared one transaction: {fx:?}"
    );
    let dups: i64 = sqlx::query_scalar("SELECT duplicates FROM txinbox.inbox WHERE message_id = 'a'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(dups, 2, "both repeats of a counted as duplicates");
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.reason, DeadLetterReason::Conflict);
    assert_eq!(&dead[0].0.payload()[..], b"pb-other");
    assert_eq!(broker.stats().acked, 6);
}

#[tokio::test]
async fn a_handler_swallowing_a_failed_statement_in_a_batch_gets_nothing_acked_as_processed() {
    let db = db().await;
    let broker = MemoryBroker::new("batch");
    broker.record_acks();
    for i in 0..4 {
        broker.publish_in_lane("l", format!("m{i}"), format!("payload {i}"));
    }
    broker.close();
    let handler = Recording {
        swallow: Some("m1"),
        ..Recording::new()
    };
    consumer("swallow-batch", &db, &broker, handler)
        .run()
        .await
        .unwrap();
    let fx = effects(&db).await;
    for i in 0..4 {
        assert_eq!(fx[&format!("m{i}")].0, 1, "m{i} applied exactly once: {fx:?}");
    }
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM txinbox.inbox WHERE message_id = 'm1'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        attempts, 2,
        "the aborted attempt of m1 was caught and counted, alone"
    );
    assert_eq!(
        broker.acks().len(),
        4,
        "each message acked once, after its effect committed"
    );
}

/// Ends its transaction (`ROLLBACK` on the connection it was handed) at its first call for
/// `ends_on`, after committing, as another worker would, a redelivery of `redelivered`: its
/// inbox row (copied from this transaction's claim, so with the same fingerprint) and its
/// effect.
struct EndsTransaction {
    pool: sqlx::PgPool,
    consumer: &'static str,
    ends_on: &'static str,
    redelivered: &'static str,
    ended: Arc<std::sync::atomic::AtomicBool>,
}

#[txinbox::async_trait]
impl Handler<Postgres> for EndsTransaction {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, _msg: &Message) -> Result<(), HandlerError> {
        let id = cx.message_id().to_string();
        record(cx.db(), &id).await?;
        if id == self.ends_on && !self.ended.swap(true, Ordering::SeqCst) {
            let row: serde_json::Value = sqlx::query_scalar(
                "SELECT to_jsonb(i) FROM txinbox.inbox i WHERE consumer = $1 AND message_id = $2",
            )
            .bind(self.consumer)
            .bind(self.redelivered)
            .fetch_one(cx.db())
            .await?;
            sqlx::raw_sql("ROLLBACK").execute(cx.db()).await?;
            let mut other = self.pool.begin().await?;
            sqlx::query(
                "INSERT INTO txinbox.inbox SELECT * FROM jsonb_populate_record(NULL::txinbox.inbox, $1)",
            )
            .bind(row)
            .execute(&mut *other)
            .await?;
            record(&mut other, self.redelivered).await?;
            other.commit().await?;
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_handler_ending_the_transaction_while_a_redelivery_commits_gets_nothing_acked_without_its_effect() {
    let db = db().await;
    let broker = MemoryBroker::new("batch");
    broker.record_acks();
    for i in 0..3 {
        broker.publish_in_lane("l", format!("e{i}"), format!("payload {i}"));
    }
    broker.close();
    let handler = EndsTransaction {
        pool: db.pool.clone(),
        consumer: "ended-batch",
        ends_on: "e2",
        redelivered: "e0",
        ended: Arc::default(),
    };
    consumer("ended-batch", &db, &broker, handler)
        .run()
        .await
        .unwrap();
    let fx = effects(&db).await;
    for i in 0..3 {
        assert_eq!(
            fx.get(&format!("e{i}")).map(|e| e.0),
            Some(1),
            "e{i} applied exactly once (e0 by the other worker): {fx:?}"
        );
    }
    assert_eq!(broker.acks().len(), 3, "each message acked once");
}

/// Ends its transaction at its first call for `c0`, and fails `c1`'s first attempt before
/// writing anything.
struct EndsThenFails {
    ended: Arc<std::sync::atomic::AtomicBool>,
}

#[txinbox::async_trait]
impl Handler<Postgres> for EndsThenFails {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, _msg: &Message) -> Result<(), HandlerError> {
        let id = cx.message_id().to_string();
        if id == "c1" && cx.attempt() == 1 {
            return Err(HandlerError::transient("flaky once"));
        }
        record(cx.db(), &id).await?;
        if id == "c0" && !self.ended.swap(true, Ordering::SeqCst) {
            sqlx::raw_sql("ROLLBACK").execute(cx.db()).await?;
        }
        Ok(())
    }
}

/// A batch bounded by its duration claims in chunks. A chunk claimed after a handler ended the
/// transaction would commit its rows at once, as processed: a message of it whose handler then
/// failed came back a duplicate, and was acked without ever having succeeded. The transaction
/// is checked before each further chunk.
#[tokio::test]
async fn a_bounded_batch_claims_no_further_chunk_on_a_transaction_a_handler_ended() {
    let db = db().await;
    let broker = MemoryBroker::new("batch");
    broker.record_acks();
    for i in 0..3 {
        broker.publish_in_lane("l", format!("c{i}"), format!("payload {i}"));
    }
    broker.close();
    Consumer::builder("ended-chunks")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(EndsThenFails {
            ended: Arc::default(),
        })
        .retry_policy(fast_retries().max_attempts(3))
        .batch_linger(Duration::from_millis(300))
        .batch_max_duration(Duration::from_secs(10))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let fx = effects(&db).await;
    assert_eq!(
        fx.get("c1").map(|e| e.0),
        Some(1),
        "c1 applied once, on its second attempt, not acked as a duplicate of a claim committed in autocommit: {fx:?}"
    );
    assert_eq!(fx.get("c2").map(|e| e.0), Some(1), "{fx:?}");
    assert_eq!(broker.acks().len(), 3, "each message acked once");
}

#[tokio::test]
async fn a_crash_with_a_batch_open_leaves_nothing_and_the_redelivery_applies_once() {
    let db = db().await;
    let broker = MemoryBroker::new("batch");
    for i in 0..6 {
        broker.publish_in_lane("l", format!("m{i}"), format!("payload {i}"));
    }
    broker.close();
    let stuck = Recording {
        block_on: Some("m3"),
        ..Recording::new()
    };
    let entered = stuck.entered.clone();
    let run = tokio::spawn(consumer("crash-batch", &db, &broker, stuck.clone()).run());
    entered.notified().await; // m0..m3 written in the open batch transaction
    assert_eq!(stuck.calls.load(Ordering::SeqCst), 4, "one batch holds m0..m3");
    run.abort(); // the process "dies" mid-batch
    let _ = run.await;

    let handler = Recording::new();
    consumer("crash-batch", &db, &broker, handler.clone())
        .run()
        .await
        .unwrap();
    let fx = effects(&db).await;
    assert_eq!(fx.len(), 6);
    for i in 0..6 {
        assert_eq!(fx[&format!("m{i}")].0, 1, "m{i} applied exactly once: {fx:?}");
    }
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        6,
        "nothing of the crashed batch committed"
    );
    assert_eq!(broker.stats().acked, 6);
    assert!(
        broker.stats().dropped_unsettled >= 6,
        "the crashed batch was not acked"
    );
}

/// Adds 1 to the `hot` row named by the payload; the first message of each lane then holds
/// its transaction a while, so two lanes' batches lock their rows in opposite orders.
struct Hot;

#[txinbox::async_trait]
impl Handler<Postgres> for Hot {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let row = std::str::from_utf8(msg.payload()).unwrap().to_owned();
        sqlx::query("UPDATE hot SET n = n + 1 WHERE id = $1")
            .bind(&row)
            .execute(cx.db())
            .await?;
        let id = cx.message_id().to_string();
        record(cx.db(), &id).await?;
        if id.ends_with("-0") {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_deadlock_between_batches_turns_batching_off_for_a_while() {
    let db = db().await;
    sqlx::raw_sql("CREATE TABLE hot (id text PRIMARY KEY, n bigint NOT NULL); INSERT INTO hot VALUES ('A', 0), ('B', 0);")
        .execute(&db.pool)
        .await
        .unwrap();
    let broker = MemoryBroker::new("batch");
    // Lane x locks A then B, lane y B then A: their batches deadlock.
    broker.publish_in_lane("x", "x-0", "A");
    broker.publish_in_lane("x", "x-1", "B");
    broker.publish_in_lane("y", "y-0", "B");
    broker.publish_in_lane("y", "y-1", "A");
    let run = tokio::spawn(consumer("hot", &db, &broker, Hot).run());
    let deadline = Instant::now() + Duration::from_secs(30);
    while db
        .scalar("SELECT count(DISTINCT message_id) FROM batch_effects")
        .await
        < 4
    {
        assert!(Instant::now() < deadline, "the deadlocked batches finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Within the cool-down a new lane's messages run one per transaction, although the
    // linger would otherwise gather them into one batch.
    for i in 0..3 {
        broker.publish_in_lane("z", format!("z-{i}"), "A");
    }
    while db
        .scalar("SELECT count(*) FROM batch_effects WHERE message_id LIKE 'z-%'")
        .await
        < 3
    {
        assert!(Instant::now() < deadline, "lane z finishes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // After the cool-down (5 s) batching grows back, although at size 1 every transaction
    // is a lone message's: w-0 runs alone, the rest of lane w queue up behind it and batch.
    tokio::time::sleep(Duration::from_millis(5500)).await;
    for i in 0..6 {
        broker.publish_in_lane("w", format!("w-{i}"), "A");
    }
    broker.close();
    run.await.unwrap().unwrap();

    let fx = effects(&db).await;
    assert_eq!(fx.len(), 13);
    assert!(fx.values().all(|(n, _)| *n == 1), "each applied once: {fx:?}");
    assert_eq!(db.scalar("SELECT sum(n)::bigint FROM hot").await, 13);
    let z: std::collections::HashSet<i64> = ["z-0", "z-1", "z-2"].iter().map(|id| fx[*id].1[0]).collect();
    assert_eq!(z.len(), 3, "after the deadlock, no batching: {fx:?}");
    let w: std::collections::HashSet<i64> = (0..6).map(|i| fx[&format!("w-{i}")].1[0]).collect();
    assert!(w.len() < 6, "after the cool-down, batching is back: {fx:?}");
}

/// One statement for the whole batch; `handle` for messages that travel alone.
#[derive(Clone, Default)]
struct Bulk {
    sizes: Arc<Mutex<Vec<usize>>>,
    alone: Arc<AtomicUsize>,
}

#[txinbox::async_trait]
impl Handler<Postgres> for Bulk {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        self.alone.fetch_add(1, Ordering::SeqCst);
        if msg.payload() == "poison" {
            return Err(HandlerError::permanent("poison"));
        }
        let id = cx.message_id().to_string();
        record(cx.db(), &id).await?;
        Ok(())
    }
    fn batch(&self) -> Option<&dyn BatchHandler<Postgres>> {
        Some(self)
    }
}

#[txinbox::async_trait]
impl BatchHandler<Postgres> for Bulk {
    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, Postgres>,
        batch: &[BatchMessage<'_>],
    ) -> Result<(), HandlerError> {
        self.sizes.lock().unwrap().push(batch.len());
        let ids: Vec<&str> = batch.iter().map(|m| m.id().as_str()).collect();
        sqlx::query(
            "INSERT INTO batch_effects (message_id, txid) SELECT id, txid_current() FROM UNNEST($1::text[]) AS id",
        )
        .bind(&ids)
        .execute(cx.db())
        .await?;
        if batch.iter().any(|m| m.message().payload() == "poison") {
            return Err(HandlerError::permanent("a poison message in the batch"));
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_batch_handler_gets_the_new_messages_at_once_and_failures_run_alone() {
    let db = db().await;
    // Unordered deliveries (no lane) batch too.
    let broker = MemoryBroker::new("batch");
    for i in 0..40 {
        broker.publish(format!("u{i}"), format!("payload {i}"));
    }
    broker.publish("u3", "payload 3"); // a duplicate: not given to the batch handler
    broker.close();
    let bulk = Bulk::default();
    Consumer::builder("bulk")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(bulk.clone())
        .concurrency(2)
        .batch_linger(Duration::from_millis(300))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let fx = effects(&db).await;
    assert_eq!(fx.len(), 40);
    assert!(fx.values().all(|(n, _)| *n == 1), "each applied once: {fx:?}");
    let sizes = bulk.sizes.lock().unwrap().clone();
    assert!(
        sizes.iter().any(|&n| n > 1),
        "the batch handler received several messages at once: {sizes:?}"
    );
    assert_eq!(
        sizes.iter().sum::<usize>() + bulk.alone.load(Ordering::SeqCst),
        40,
        "every new message handled once, the duplicate never: {sizes:?}"
    );
    assert_eq!(broker.stats().acked, 41);

    // A failing batch handler: rolled back whole, then each message alone.
    let broker = MemoryBroker::new("batch");
    broker.publish_in_lane("l", "p0", "fine");
    broker.publish_in_lane("l", "p1", "poison");
    broker.publish_in_lane("l", "p2", "fine");
    broker.close();
    let bulk = Bulk::default();
    consumer("bulk-fail", &db, &broker, bulk.clone())
        .run()
        .await
        .unwrap();
    let fx = effects(&db).await;
    assert_eq!(fx["p0"].0, 1);
    assert_eq!(fx["p2"].0, 1);
    assert!(!fx.contains_key("p1"), "nothing of the failed batch stayed");
    assert_eq!(
        *bulk.sizes.lock().unwrap(),
        [3],
        "one batch of three, rolled back"
    );
    assert_eq!(bulk.alone.load(Ordering::SeqCst), 3, "then each message alone");
    assert_eq!(broker.dead_letters()[0].1.reason, DeadLetterReason::Permanent);
}

/// A handler waiting on slow I/O: sleeps 5 ms, then writes its effect with its transaction's
/// ID and how long that transaction had run when the handler started.
#[derive(Clone)]
struct Sleepy;

const SLEEP: Duration = Duration::from_millis(5);

#[txinbox::async_trait]
impl Handler<Postgres> for Sleepy {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let id = cx.message_id().to_string();
        sqlx::query(
            "INSERT INTO batch_effects (message_id, txid, ran_ms, at_ms)
             VALUES ($1, txid_current(), extract(epoch FROM clock_timestamp() - now()) * 1000,
                     extract(epoch FROM clock_timestamp()) * 1000)",
        )
        .bind(&id)
        .execute(cx.db())
        .await?;
        // "fast": an event the handler ignores, returning at once.
        if msg.payload() != "fast" {
            tokio::time::sleep(SLEEP).await;
        }
        Ok(())
    }
}

/// `batch_max_duration`: a batch whose transaction has run for the duration takes no more
/// messages; it commits what it took and the next transaction takes the rest, in lane order.
/// 60 messages of one lane are queued before the consumer starts and `batch_size` would take
/// them all; the handler sleeps 5 ms, so a 50 ms batch holds at most about ten (its last chunk
/// may end one handler past the duration). Without the bound, one transaction holds all 60 and
/// runs for 300 ms.
#[tokio::test]
async fn a_batch_that_ran_for_its_max_duration_takes_no_more_messages() {
    let db = db().await;
    sqlx::raw_sql("ALTER TABLE batch_effects ADD COLUMN ran_ms float8, ADD COLUMN at_ms float8")
        .execute(&db.pool)
        .await
        .unwrap();
    let broker = MemoryBroker::new("batch");
    for i in 0..60 {
        broker.publish_in_lane("l", format!("m{i:02}"), "p");
    }
    broker.close();
    let max = Duration::from_millis(50);
    Consumer::builder("bounded")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(Sleepy)
        .batch_size(1000)
        .max_in_flight(1000)
        .batch_linger(Duration::from_millis(300))
        .batch_max_duration(max)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();

    let rows: Vec<(String, i64, f64)> =
        sqlx::query_as("SELECT message_id, txid, ran_ms FROM batch_effects ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let ids: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    let expected: Vec<String> = (0..60).map(|i| format!("m{i:02}")).collect();
    assert_eq!(ids, expected, "every message once, in lane order");
    assert_eq!(broker.stats().acked, 60);
    // Transactions in commit order: (messages, how long it had run when its last handler started).
    let mut batches: Vec<(i64, usize, f64)> = Vec::new();
    for (_, txid, ran) in &rows {
        match batches.last_mut() {
            Some(b) if b.0 == *txid => {
                b.1 += 1;
                b.2 = b.2.max(*ran);
            }
            _ => batches.push((*txid, 1, *ran)),
        }
    }
    let sizes: Vec<usize> = batches.iter().map(|b| b.1).collect();
    // A handler never takes less than SLEEP, so the duration fits at most max / SLEEP of them;
    // the last chunk is claimed before the duration passed and may hold one more.
    let most = (max.as_millis() / SLEEP.as_millis()) as usize + 1;
    assert!(
        sizes.iter().all(|&n| n <= most),
        "no transaction takes more than {most} messages of a 5 ms handler in 50 ms: sizes {sizes:?}, \
         ran (ms) {:?}",
        batches.iter().map(|b| b.2.round()).collect::<Vec<_>>()
    );
    assert!(sizes.iter().any(|&n| n >= 2), "it still batches: sizes {sizes:?}");
}

/// With `batch_max_duration`, a task takes from the unordered queue only what the duration fits
/// at the handlers' pace, so a burst of slow messages runs in transactions side by side rather
/// than in one task after another. A first message measures the pace; then 40 are queued at
/// once (`batch_size` would give them all to one task, whose bounded transactions would run one
/// after another).
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_slow_unordered_messages_spreads_over_concurrent_bounded_batches() {
    let db = db().await;
    sqlx::raw_sql("ALTER TABLE batch_effects ADD COLUMN ran_ms float8, ADD COLUMN at_ms float8")
        .execute(&db.pool)
        .await
        .unwrap();
    let broker = MemoryBroker::new("batch");
    let consumer = Consumer::builder("bounded-burst")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(Sleepy)
        .batch_size(1000)
        .max_in_flight(1000)
        .batch_linger(Duration::from_millis(300))
        .batch_max_duration(Duration::from_millis(50))
        .build()
        .unwrap();
    let running = tokio::spawn(consumer.run());
    let settled = |n: u64| {
        let broker = broker.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            while broker.stats().acked < n {
                assert!(
                    Instant::now() < deadline,
                    "{} of {n} settled",
                    broker.stats().acked
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    broker.publish("warm-up", "p");
    settled(1).await;
    for i in 0..40 {
        broker.publish(format!("m{i:02}"), "p");
    }
    settled(41).await;
    running.abort();

    // Per transaction of the burst: when its first and its last handler started.
    let spans: Vec<(i64, f64, f64, i64)> = sqlx::query_as(
        "SELECT txid, min(at_ms), max(at_ms), count(*) FROM batch_effects
         WHERE message_id <> 'warm-up' GROUP BY txid ORDER BY min(at_ms)",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        spans.iter().map(|s| s.3).sum::<i64>(),
        40,
        "every message once: {spans:?}"
    );
    let overlapping = spans
        .iter()
        .enumerate()
        .any(|(i, a)| spans[i + 1..].iter().any(|b| b.1 < a.2));
    assert!(
        overlapping,
        "the burst's transactions ran side by side, not one after another: {spans:?}"
    );
}

/// Transaction sizes of `batch_effects` rows other than `except`, in commit order.
async fn transaction_sizes(pool: &sqlx::PgPool, except: &[&str]) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM batch_effects WHERE NOT (message_id = ANY($1))
         GROUP BY txid ORDER BY min(seq)",
    )
    .bind(except)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Waits until `broker` has acked `n` messages (20 s at most).
async fn acked(broker: &MemoryBroker, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while broker.stats().acked < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} settled",
            broker.stats().acked
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The handlers' pace is the slowest of the last few batches: two events the handler ignores
/// (returning at once) after a slow one must not size the next batch of slow messages as if
/// they were fast. Before, the last call set the pace alone: the
/// 60 slow messages were claimed in one chunk and ran in one 300 ms transaction against a
/// 50 ms bound.
#[tokio::test(flavor = "multi_thread")]
async fn a_few_fast_calls_do_not_let_the_next_slow_batch_run_far_past_its_duration() {
    let db = db().await;
    sqlx::raw_sql("ALTER TABLE batch_effects ADD COLUMN ran_ms float8, ADD COLUMN at_ms float8")
        .execute(&db.pool)
        .await
        .unwrap();
    let broker = MemoryBroker::new("batch");
    let max = Duration::from_millis(50);
    let consumer = Consumer::builder("bounded-mixed")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(Sleepy)
        .batch_size(1000)
        .max_in_flight(1000)
        .batch_linger(Duration::from_millis(300))
        .batch_max_duration(max)
        .build()
        .unwrap();
    let running = tokio::spawn(consumer.run());
    broker.publish_in_lane("l", "slow-0", "p");
    acked(&broker, 1).await;
    broker.publish_in_lane("l", "fast-1", "fast");
    acked(&broker, 2).await;
    broker.publish_in_lane("l", "fast-2", "fast");
    acked(&broker, 3).await;
    for i in 0..60 {
        broker.publish_in_lane("l", format!("m{i:02}"), "p");
    }
    acked(&broker, 63).await;
    running.abort();

    let sizes = transaction_sizes(&db.pool, &["slow-0", "fast-1", "fast-2"]).await;
    assert_eq!(sizes.iter().sum::<i64>(), 60, "every message once: {sizes:?}");
    // The pace is the slowest of the last four (5 ms, with the two fast ones beside it): about
    // ten per chunk; allow twice what fits at the true pace, plus the last chunk's one.
    let most = 2 * (max.as_millis() / SLEEP.as_millis()) as i64 + 1;
    assert!(
        sizes.iter().all(|&n| n <= most),
        "no transaction of 5 ms handlers holds more than {most} under a 50 ms bound: {sizes:?}"
    );
}

/// A batch handler: alone, a message takes 60 ms; a batch is one call that records its size.
#[derive(Clone, Default)]
struct SlowAlone {
    sizes: Arc<Mutex<Vec<usize>>>,
}

#[txinbox::async_trait]
impl Handler<Postgres> for SlowAlone {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, _msg: &Message) -> Result<(), HandlerError> {
        let id = cx.message_id().to_string();
        record(cx.db(), &id).await?;
        tokio::time::sleep(Duration::from_millis(60)).await;
        Ok(())
    }
    fn batch(&self) -> Option<&dyn BatchHandler<Postgres>> {
        Some(self)
    }
}

#[txinbox::async_trait]
impl BatchHandler<Postgres> for SlowAlone {
    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, Postgres>,
        batch: &[BatchMessage<'_>],
    ) -> Result<(), HandlerError> {
        self.sizes.lock().unwrap().push(batch.len());
        for m in batch {
            record(cx.db(), m.id().as_str()).await?;
        }
        Ok(())
    }
}

/// `batch_max_duration` has no effect on a batch handler's batches, as documented: a lone
/// message whose `handle` took longer than the bound must not turn its batching off. Before,
/// the lone call set a pace of 60 ms, and every later task took one message at a time.
#[tokio::test(flavor = "multi_thread")]
async fn batch_max_duration_leaves_a_batch_handlers_batches_whole() {
    let db = db().await;
    let broker = MemoryBroker::new("batch");
    let handler = SlowAlone::default();
    let consumer = Consumer::builder("bounded-batch-handler")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler.clone())
        .batch_size(1000)
        .max_in_flight(1000)
        .batch_linger(Duration::from_millis(300))
        .batch_max_duration(Duration::from_millis(50))
        .build()
        .unwrap();
    let running = tokio::spawn(consumer.run());
    broker.publish_in_lane("l", "alone", "p");
    acked(&broker, 1).await;
    for i in 0..50 {
        broker.publish_in_lane("l", format!("m{i:02}"), "p");
    }
    acked(&broker, 51).await;
    running.abort();
    let sizes = handler.sizes.lock().unwrap().clone();
    assert_eq!(
        sizes.iter().sum::<usize>(),
        50,
        "the 50 went through handle_batch: {sizes:?}"
    );
    assert!(
        sizes.iter().any(|&n| n > 1),
        "batches of more than one message: {sizes:?}"
    );
}
