//! Transient failures: retried without burning the key, the attempt counted; a transaction the
//! handler broke is rolled back and retried, never acked as processed.

use sqlx::Postgres;
use txinbox::memory::MemoryBroker;
use txinbox::{Consumer, Context, Handler, HandlerError, Message};

use super::support::{deposit_in_lane, drain, fast_retries, DepositHandler, TestDb};

#[tokio::test]
async fn transient_failures_are_retried_and_counted_without_burning_the_key() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
    broker.close();
    let handler = DepositHandler::failing(|_, attempt| {
        (attempt <= 2).then(|| HandlerError::transient(format!("flaky downstream, attempt {attempt}")))
    });
    drain("retries", &db, &broker, handler.clone()).await;

    assert_eq!(db.balance("alice").await, 10);
    assert_eq!(handler.calls(), 3);
    let (status, attempts, last_error): (String, i32, Option<String>) = sqlx::query_as(
        "SELECT status, attempts, last_error FROM txinbox.inbox WHERE consumer = 'retries' AND message_id = 'evt-1'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), attempts), ("processed", 3));
    assert_eq!(last_error.as_deref(), Some("flaky downstream, attempt 2"));
    assert_eq!(broker.stats().retried, 2, "redelivered twice through the broker");
}

/// Ignores a failed statement on its first attempt, which aborts the PostgreSQL
/// transaction; COMMIT then rolls back without reporting an error.
struct SwallowsErrors(DepositHandler);

#[txinbox::async_trait]
impl Handler<Postgres> for SwallowsErrors {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        self.0.handle(cx, msg).await?;
        if cx.attempt() == 1 {
            let _ = sqlx::query("SELECT 1 / 0").execute(cx.db()).await; // error ignored
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_handler_that_swallows_a_database_error_is_not_acked_as_processed() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
    broker.close();
    Consumer::builder("swallow")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(SwallowsErrors(DepositHandler::default()))
        .retry_policy(fast_retries())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!(
        db.balance("alice").await,
        10,
        "applied once, by the second attempt"
    );
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM txinbox.inbox WHERE message_id = 'evt-1'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(attempts, 2);
}
