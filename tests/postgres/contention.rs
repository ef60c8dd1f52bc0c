//! Lock conflicts (deadlock, serialization failure, lock timeout) are not the message's fault:
//! they are re-run with backoff and never spend one of its attempts, on the one-message path
//! as on the batch path, whether the handler or COMMIT hits them.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use txinbox::memory::MemoryBroker;
use txinbox::{dead_letter::DeadLetterReason, Consumer, HandlerError};

use super::support::{deposit_in_lane, fast_retries, DepositHandler, TestDb};

/// Makes PostgreSQL raise `code` in the handler's transaction, as a real lock conflict would.
async fn raise(conn: &mut sqlx::PgConnection, code: &str) -> Result<(), sqlx::Error> {
    let sql =
        format!("DO $$ BEGIN RAISE EXCEPTION 'simulated lock conflict' USING ERRCODE = '{code}'; END $$");
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(conn)
        .await
        .map(|_| ())
}

/// A deposit handler whose first `conflicts` calls lose a lock conflict with `code`.
struct Contended {
    inner: DepositHandler,
    conflicts: u32,
    code: &'static str,
    calls: Arc<AtomicU32>,
    attempts_seen: Arc<std::sync::Mutex<Vec<u32>>>,
}

#[txinbox::async_trait]
impl txinbox::Handler<sqlx::Postgres> for Contended {
    async fn handle(
        &self,
        cx: &mut txinbox::Context<'_, sqlx::Postgres>,
        msg: &txinbox::Message,
    ) -> Result<(), HandlerError> {
        self.attempts_seen.lock().unwrap().push(cx.attempt());
        if self.calls.fetch_add(1, Ordering::SeqCst) < self.conflicts {
            raise(cx.db(), self.code).await?;
        }
        self.inner.handle(cx, msg).await
    }
}

#[tokio::test]
async fn lock_conflicts_in_the_handler_never_spend_attempts() {
    for code in ["40P01", "40001", "55P03"] {
        let db = TestDb::new(10).await;
        let broker = MemoryBroker::new("payments");
        broker.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
        broker.close();
        let handler = Contended {
            inner: DepositHandler::default(),
            conflicts: 6,
            code,
            calls: Arc::default(),
            attempts_seen: Arc::default(),
        };
        let (calls, seen) = (handler.calls.clone(), handler.attempts_seen.clone());
        Consumer::builder("contention")
            .source(broker.source())
            .inbox(db.inbox())
            .handler(handler)
            // Fewer attempts than conflicts: each conflict spending one would dead-letter it.
            .retry_policy(fast_retries().max_attempts(3))
            .build()
            .unwrap()
            .run()
            .await
            .unwrap();
        assert_eq!(db.balance("alice").await, 10, "{code}: applied once");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            7,
            "{code}: six conflicts, then success"
        );
        assert!(
            seen.lock().unwrap().iter().all(|&a| a == 1),
            "{code}: every run is attempt 1: {:?}",
            seen.lock().unwrap()
        );
        let (status, attempts): (String, i32) = sqlx::query_as(
            "SELECT status, attempts FROM txinbox.inbox WHERE consumer = 'contention' AND message_id = 'evt-1'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!((status.as_str(), attempts), ("processed", 1), "{code}");
        assert_eq!(
            db.scalar("SELECT count(*) FROM txinbox.dead_letters").await,
            0,
            "{code}"
        );
        assert_eq!(
            broker.stats().retried,
            0,
            "{code}: re-run in place, not through the broker"
        );
    }
}

#[tokio::test]
async fn a_serialization_failure_at_commit_never_spends_attempts() {
    let db = TestDb::new(10).await;
    // A deferred constraint trigger that fails COMMIT with a serialization failure for the
    // first five transactions that write an effect (a sequence is not rolled back).
    sqlx::raw_sql(
        "CREATE SEQUENCE commit_failures;
         CREATE FUNCTION fail_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('commit_failures') <= 5 THEN
                 RAISE EXCEPTION 'could not serialize access' USING ERRCODE = '40001';
             END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER fail_commit AFTER INSERT ON effects
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_commit();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
    broker.close();
    let handler = DepositHandler::default();
    Consumer::builder("commit-contention")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler.clone())
        .retry_policy(fast_retries().max_attempts(3))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!(db.balance("alice").await, 10);
    assert_eq!(handler.calls(), 6, "five failed COMMITs, then one that holds");
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 0);
    assert_eq!(
        db.scalar("SELECT attempts::bigint FROM txinbox.inbox WHERE consumer = 'commit-contention'")
            .await,
        1
    );
}

/// A lock conflict is transient; a statement timeout or a session ended for idling in a
/// transaction may be the message's own doing (a slow query, a handler waiting on a remote
/// call), so those do count, and end in a dead letter rather than a loop.
#[tokio::test]
async fn a_statement_timeout_in_the_handler_counts_as_an_attempt() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
    broker.close();
    let handler = Contended {
        inner: DepositHandler::default(),
        conflicts: u32::MAX,
        code: "57014",
        calls: Arc::default(),
        attempts_seen: Arc::default(),
    };
    let calls = handler.calls.clone();
    Consumer::builder("timeouts")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler)
        .retry_policy(fast_retries().max_attempts(3))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(
        broker.dead_letters()[0].1.reason,
        DeadLetterReason::AttemptsExhausted
    );
}

/// Records the transaction each message ran in; messages with IDs starting `hot` lose a lock
/// conflict until `hot_for` has passed (a row locked elsewhere for that long).
struct HotCold {
    started: Instant,
    hot_for: Duration,
}

#[txinbox::async_trait]
impl txinbox::Handler<sqlx::Postgres> for HotCold {
    async fn handle(
        &self,
        cx: &mut txinbox::Context<'_, sqlx::Postgres>,
        _msg: &txinbox::Message,
    ) -> Result<(), HandlerError> {
        let id = cx.message_id().as_str().to_owned();
        if id.starts_with("hot") && self.started.elapsed() < self.hot_for {
            raise(cx.db(), "55P03").await?;
        }
        sqlx::query("INSERT INTO tx_of (consumer, id, tx) VALUES ($1, $2, txid_current())")
            .bind(cx.consumer().to_owned())
            .bind(id)
            .execute(cx.db())
            .await?;
        Ok(())
    }
}

/// One message that keeps losing lock conflicts holds its own lane, not the batching of the
/// others: the cold lane's messages share transactions as they do without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_keeps_losing_lock_conflicts_does_not_turn_batching_off_for_other_lanes() {
    let db = TestDb::new(10).await;
    sqlx::query("CREATE TABLE tx_of (consumer text, id text, tx bigint)")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut transactions = Vec::new();
    for (name, hot) in [("control", false), ("with-hot", true)] {
        let broker = MemoryBroker::new("payments");
        if hot {
            broker.publish_in_lane("hot", "hot-1", "{}");
        }
        let feeder = {
            let broker = broker.clone();
            tokio::spawn(async move {
                // Past CONTENTION_COOLDOWN (5 s) after the hot message's first conflict, while
                // it still loses.
                tokio::time::sleep(Duration::from_secs(6)).await;
                for i in 0..300 {
                    broker.publish_in_lane("cold", format!("cold-{i}"), "{}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                broker.close();
            })
        };
        Consumer::builder(name)
            .source(broker.source())
            .inbox(db.inbox())
            .handler(HotCold {
                started: Instant::now(),
                hot_for: Duration::from_secs(10),
            })
            .batch_linger(Duration::from_millis(50))
            .build()
            .unwrap()
            .run()
            .await
            .unwrap();
        feeder.await.unwrap();
        let txs: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT tx) FROM tx_of WHERE consumer = $1 AND id LIKE 'cold-%'",
        )
        .bind(name)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        transactions.push(txs);
    }
    let (control, with_hot) = (transactions[0], transactions[1]);
    eprintln!("300 cold messages: {control} transactions alone, {with_hot} beside a hot message");
    // Batching is off for CONTENTION_COOLDOWN (5 s) after the hot message's first conflict,
    // then grows back while the hot message still loses: well under one transaction each.
    assert!(
        with_hot < 150,
        "{with_hot} transactions for 300 cold messages beside a hot one ({control} alone)"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM tx_of WHERE id = 'hot-1'").await,
        1,
        "the hot message ran once its row was free"
    );
}
