//! `txinbox::testing::HandlerTest` reports what production does with a handler's result, on
//! both stores: applied, duplicate, retry (then applied on the next attempt, counted in the
//! database), dead letters (permanent, undecodable, attempts exhausted, a conflicting payload,
//! no ID), an `Ok` after an ignored failed statement (nothing commits: retry), and the effects
//! and outbox rows a test can read back. Each case is also run through a `Consumer` on the
//! in-memory broker, and the broker's settlement must agree.
//!
//! PostgreSQL at `DATABASE_URL` (a scratch database) and a scratch SQLite file.
#![cfg(all(
    feature = "testing",
    feature = "sqlite",
    feature = "postgres",
    feature = "memory"
))]

use std::time::Duration;

use txinbox::dead_letter::DeadLetterReason;
use txinbox::memory::MemoryBroker;
use txinbox::outbox::OutboxMessage;
use txinbox::testing::{HandlerTest, Outcome};
use txinbox::{Consumer, Context, Handler, HandlerError, InboxStore, Message, RetryPolicy};
use txinbox_testing::database::TestDatabase;

/// What a test message asks the handler to do.
#[derive(serde::Deserialize)]
struct Order {
    /// `ok`, `transient`, `permanent`, `swallow` (run a failing statement, ignore it, return Ok).
    action: String,
    amount: i64,
}

/// Writes an effect row and an outbox message, then does what the order says.
struct Orders;

macro_rules! orders_handler {
    ($db:ty, $insert:literal, $bad:literal) => {
        #[txinbox::async_trait]
        impl Handler<$db> for Orders {
            async fn handle(&self, cx: &mut Context<'_, $db>, msg: &Message) -> Result<(), HandlerError> {
                let order: Order = msg.json()?;
                let id = cx.message_id().as_str().to_owned();
                txinbox::sqlx::query($insert)
                    .bind(&id)
                    .bind(order.amount)
                    .execute(cx.db())
                    .await?;
                cx.outbox(&OutboxMessage::new(
                    cx.derive_id("placed"),
                    "orders.placed",
                    id.clone(),
                ))
                .await?;
                match order.action.as_str() {
                    "transient" => Err(HandlerError::transient("the warehouse is busy")),
                    "permanent" => Err(HandlerError::permanent("no such product")),
                    "swallow" => {
                        let _ = txinbox::sqlx::query($bad).execute(cx.db()).await;
                        Ok(())
                    }
                    _ => Ok(()),
                }
            }
        }
    };
}

orders_handler!(
    txinbox::sqlx::Sqlite,
    "INSERT INTO orders (message_id, amount) VALUES (?1, ?2)",
    "INSERT INTO no_such_table VALUES (1)"
);
orders_handler!(
    txinbox::sqlx::Postgres,
    "INSERT INTO orders (message_id, amount) VALUES ($1, $2)",
    "INSERT INTO no_such_table VALUES (1)"
);

const ORDERS: &str = "CREATE TABLE orders (message_id TEXT PRIMARY KEY, amount BIGINT NOT NULL)";

fn order(action: &str, amount: i64) -> String {
    format!(r#"{{"action": "{action}", "amount": {amount}}}"#)
}

/// The same message through a production consumer on the in-memory broker: the broker's
/// settlement, as an outcome (`Applied`'s attempt and `Retry`'s delay are not compared).
async fn through_a_consumer<St>(
    inbox: St,
    name: &str,
    id: &str,
    payload: String,
    retry: RetryPolicy,
) -> String
where
    St: InboxStore,
    Orders: Handler<St::Db>,
{
    let broker = MemoryBroker::new("orders");
    broker.publish(id, payload);
    let consumer = Consumer::builder(name)
        .source(broker.source())
        .inbox(inbox)
        .handler(Orders)
        .retry_policy(retry)
        .concurrency(1)
        .build()
        .unwrap();
    let watched = broker.clone();
    let run = tokio::spawn(consumer.run_until(async move {
        // Settled once: acked, dead-lettered, or a retry scheduled.
        while watched.stats().acked + watched.stats().dead_lettered + watched.stats().retried == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }));
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("settled within 30 s")
        .unwrap()
        .unwrap();
    // The first settlement: a retry comes before anything else the redelivery may reach.
    let stats = broker.stats();
    match (stats.retried, broker.dead_letters().first(), stats.acked) {
        (1.., _, _) => "retry".into(),
        (0, Some((_, dl)), _) => format!("dead-lettered {}", dl.reason),
        (0, None, 1) => "acked".into(),
        other => panic!("unexpected settlement {other:?}"),
    }
}

fn kind(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Applied { .. } | Outcome::Duplicate => "acked".into(),
        Outcome::Retry { .. } => "retry".into(),
        Outcome::DeadLettered(dl) => format!("dead-lettered {}", dl.reason),
        other => panic!("unexpected outcome {other:?}"),
    }
}

/// Every outcome on one store. `count` reads a `SELECT count(*)`.
macro_rules! every_outcome {
    ($test:expr, $count:expr, $outbox:literal, $other_inbox:expr) => {{
        let test = $test;
        let count = $count;
        let retry = RetryPolicy::default()
            .max_attempts(2)
            .initial_delay(Duration::from_millis(1))
            .max_delay(Duration::from_millis(1));
        let test = test.retry_policy(retry.clone());
        test.execute(ORDERS).await.unwrap();

        // Applied, then a duplicate: the effect and the outbox row are there once.
        let placed = test.message("o-1", order("ok", 5));
        assert_eq!(
            test.deliver(placed.clone()).await.unwrap(),
            Outcome::Applied { attempt: 1 }
        );
        assert_eq!(test.deliver(placed).await.unwrap(), Outcome::Duplicate);
        assert_eq!(
            count(&test, "SELECT count(*) FROM orders WHERE message_id = 'o-1'").await,
            1
        );
        assert_eq!(count(&test, "SELECT count(*) FROM orders").await, 1);

        // Same ID, other payload: a conflict, the handler does not run.
        let other = test.message("o-1", order("ok", 6));
        assert!(test.deliver(other).await.unwrap().is_dead_lettered("conflict"));

        // Transient: rolled back, the attempt counted; the next delivery is attempt 2, and the
        // last one the retry policy allows is dead-lettered.
        let flaky = test.message("o-2", order("transient", 7));
        assert!(matches!(
            test.deliver(flaky.clone()).await.unwrap(),
            Outcome::Retry { attempt: 1, .. }
        ));
        assert_eq!(
            count(&test, "SELECT count(*) FROM orders WHERE message_id = 'o-2'").await,
            0
        );
        assert_eq!(
            test.deliver(flaky).await.unwrap().dead_letter_reason(),
            Some(DeadLetterReason::AttemptsExhausted)
        );

        // Permanent and undecodable: dead-lettered on the first attempt, nothing written.
        let refused = test
            .deliver(test.message("o-3", order("permanent", 1)))
            .await
            .unwrap();
        assert!(refused.is_dead_lettered("permanent_error"), "{refused:?}");
        let garbage = test.deliver(test.message("o-4", "{not json")).await.unwrap();
        assert!(garbage.is_dead_lettered("undecodable"), "{garbage:?}");

        // A handler that ignored a failed statement and returned Ok: nothing commits, retried.
        let swallowed = test
            .deliver(test.message("o-5", order("swallow", 1)))
            .await
            .unwrap();
        assert!(
            matches!(swallowed, Outcome::Retry { attempt: 1, .. }),
            "{swallowed:?}"
        );
        assert_eq!(
            count(&test, "SELECT count(*) FROM orders WHERE message_id = 'o-5'").await,
            0
        );

        // No ID under the strategy: dead-lettered without running the handler.
        let anonymous = Message::new(order("ok", 1), txinbox::message::Origin::new("test", "orders"));
        assert!(test
            .deliver(anonymous)
            .await
            .unwrap()
            .is_dead_lettered("missing_id"));

        // Only the applied message left an effect and an outbox row.
        assert_eq!(count(&test, "SELECT count(*) FROM orders").await, 1);
        assert_eq!(count(&test, $outbox).await, 1);

        // A production consumer on the in-memory broker settles each case the same way.
        for (i, action) in ["ok", "transient", "permanent", "swallow"]
            .into_iter()
            .enumerate()
        {
            let harness = test
                .deliver(test.message(&format!("h-{i}"), order(action, 1)))
                .await
                .unwrap();
            let production = through_a_consumer(
                $other_inbox,
                "handler-test-production",
                &format!("p-{i}"),
                order(action, 1),
                retry.clone(),
            )
            .await;
            assert_eq!(kind(&harness), production, "{action}");
        }
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_test_outcomes_match_production_on_sqlite() {
    let test = HandlerTest::sqlite(Orders).await.unwrap();
    // The production run uses a store of its own (another consumer name, same tables).
    let other = test.inbox().clone();
    async fn count(test: &HandlerTest<txinbox::SqliteInbox, Orders>, sql: &str) -> i64 {
        txinbox::sqlx::query_scalar(txinbox::sqlx::AssertSqlSafe(sql))
            .fetch_one(test.pool())
            .await
            .unwrap()
    }
    every_outcome!(test, count, "SELECT count(*) FROM txinbox_outbox", other.clone());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_test_outcomes_match_production_on_postgres() {
    let db = TestDatabase::builder("handler_test")
        .migrate(false)
        .create()
        .await;
    let test = HandlerTest::postgres(db.url(), Orders).await.unwrap();
    let other = test.inbox().clone();
    async fn count(test: &HandlerTest<txinbox::PostgresInbox, Orders>, sql: &str) -> i64 {
        txinbox::sqlx::query_scalar(txinbox::sqlx::AssertSqlSafe(sql))
            .fetch_one(test.pool())
            .await
            .unwrap()
    }
    every_outcome!(test, count, "SELECT count(*) FROM txinbox.outbox", other.clone());

    db.drop_database().await;
}
