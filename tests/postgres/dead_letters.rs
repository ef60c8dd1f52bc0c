//! Dead letters: exhausted attempts, permanent failures and a commit that cannot succeed are
//! dead-lettered, and the lane moves on.

use sqlx::Postgres;
use txinbox::memory::MemoryBroker;
use txinbox::{dead_letter::DeadLetterReason, Consumer, Context, Handler, HandlerError, Message};

use super::support::{deposit_in_lane, drain, fast_retries, DepositHandler, TestDb};

#[tokio::test]
async fn exhausted_attempts_are_dead_lettered() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
    broker.close();
    let handler = DepositHandler::failing(|_, _| Some(HandlerError::transient("always down")));
    Consumer::builder("exhausted")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler.clone())
        .retry_policy(fast_retries().max_attempts(4))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!(handler.calls(), 4);
    let (reason, attempts): (String, i32) =
        sqlx::query_as("SELECT reason, attempts FROM txinbox.dead_letters WHERE consumer = 'exhausted'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((reason.as_str(), attempts), ("attempts_exhausted", 4));
    assert_eq!(
        broker.dead_letters()[0].1.reason,
        DeadLetterReason::AttemptsExhausted
    );
}

#[tokio::test]
async fn permanent_failure_is_dead_lettered_and_its_lane_moves_on() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish_in_lane("l", "poison", deposit_in_lane("alice", 1, "l", 0));
    broker.publish_in_lane("l", "next", deposit_in_lane("alice", 5, "l", 1));
    broker.publish_in_lane("l", "garbage", "{not json");
    broker.close();
    let handler = DepositHandler::failing(|m, _| {
        (m.native_id() == Some("poison")).then(|| HandlerError::permanent("account is closed"))
    });
    drain("poison", &db, &broker, handler.clone()).await;

    assert_eq!(
        db.balance("alice").await,
        5,
        "the next message in the lane was applied"
    );
    let rows: Vec<(String, String, String, Vec<u8>)> = sqlx::query_as(
        "SELECT message_id, reason, error, payload FROM txinbox.dead_letters ORDER BY message_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (rows[0].0.as_str(), rows[0].1.as_str()),
        ("garbage", "undecodable")
    );
    assert_eq!(rows[0].3, b"{not json");
    assert_eq!(
        (rows[1].0.as_str(), rows[1].1.as_str()),
        ("poison", "permanent_error")
    );
    assert_eq!(rows[1].2, "account is closed");
    assert_eq!(broker.stats().acked, 1);
    assert_eq!(broker.stats().dead_lettered, 2);

    // A later redelivery of the dead-lettered message (say its broker-side dead-letter copy
    // was never confirmed) goes to the broker's dead-letter destination again, with its
    // recorded reason, without running the handler or recording a second dead letter.
    let again = MemoryBroker::new("payments");
    again.publish_in_lane("l", "poison", deposit_in_lane("alice", 1, "l", 0));
    again.close();
    let calls = handler.calls();
    drain("poison", &db, &again, handler.clone()).await;
    assert_eq!(handler.calls(), calls);
    assert_eq!((again.stats().acked, again.stats().dead_lettered), (0, 1));
    let (_, resent) = &again.dead_letters()[0];
    assert_eq!(
        (resent.reason, resent.error.as_str()),
        (DeadLetterReason::Permanent, "account is closed")
    );
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 2);
}

#[tokio::test]
async fn a_constraint_failing_at_commit_is_counted_and_dead_lettered_not_fatal() {
    let db = TestDb::new(10).await;
    sqlx::raw_sql(
        "CREATE TABLE parents (id text PRIMARY KEY);
         CREATE TABLE children (parent text REFERENCES parents DEFERRABLE INITIALLY DEFERRED);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    struct Orphans(DepositHandler);
    #[txinbox::async_trait]
    impl Handler<Postgres> for Orphans {
        async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
            self.0.handle(cx, msg).await?;
            if msg.native_id() == Some("orphan") {
                // Checked only at COMMIT.
                sqlx::query("INSERT INTO children VALUES ('nobody')")
                    .execute(cx.db())
                    .await?;
            }
            Ok(())
        }
    }
    let broker = MemoryBroker::new("payments");
    broker.publish_in_lane("l", "orphan", deposit_in_lane("alice", 1, "l", 0));
    broker.publish_in_lane("l", "fine", deposit_in_lane("alice", 5, "l", 1));
    broker.close();
    Consumer::builder("deferred")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(Orphans(DepositHandler::default()))
        .retry_policy(fast_retries().max_attempts(3))
        .build()
        .unwrap()
        .run()
        .await
        .expect("a message that cannot commit does not stop the consumer");
    assert_eq!(db.balance("alice").await, 5);
    let (reason, attempts): (String, i32) =
        sqlx::query_as("SELECT reason, attempts FROM txinbox.dead_letters WHERE message_id = 'orphan'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((reason.as_str(), attempts), ("attempts_exhausted", 3));
}

/// A handler that decodes with `serde_json::from_slice(..)?` (not `msg.json()`): a payload
/// that cannot be decoded (bad syntax, wrong shape, cut short) is dead-lettered `undecodable`
/// on its first attempt, not retried in place while its lane waits.
#[tokio::test]
async fn a_decode_error_raised_with_question_mark_is_dead_lettered_on_the_first_attempt() {
    #[derive(serde::Deserialize)]
    struct Deposit {
        account: String,
        amount: i64,
    }
    /// Records the highest attempt it ran.
    #[derive(Clone, Default)]
    struct FromSlice(std::sync::Arc<std::sync::atomic::AtomicU32>);
    #[txinbox::async_trait]
    impl Handler<Postgres> for FromSlice {
        async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
            self.0
                .fetch_max(cx.attempt(), std::sync::atomic::Ordering::SeqCst);
            let d: Deposit = serde_json::from_slice(msg.payload())?;
            sqlx::query(
                "INSERT INTO accounts (id, balance) VALUES ($1, $2)
                 ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
            )
            .bind(&d.account)
            .bind(d.amount)
            .execute(cx.db())
            .await?;
            Ok(())
        }
    }
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish_in_lane("l", "syntax", "{not json");
    broker.publish_in_lane("l", "data", r#"{"account": 5, "amount": 1}"#);
    broker.publish_in_lane("l", "eof", r#"{"account": "alice", "amo"#);
    broker.publish_in_lane("l", "good", r#"{"account": "alice", "amount": 7}"#);
    broker.close();
    let handler = FromSlice::default();
    Consumer::builder("from_slice")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler.clone())
        .retry_policy(fast_retries().max_attempts(5))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();

    assert_eq!(db.balance("alice").await, 7, "the lane moved on");
    let rows: Vec<(String, String, i32)> =
        sqlx::query_as("SELECT message_id, reason, attempts FROM txinbox.dead_letters ORDER BY message_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let expected: Vec<(String, String, i32)> = ["data", "eof", "syntax"]
        .into_iter()
        .map(|id| (id.to_owned(), "undecodable".to_owned(), 1))
        .collect();
    assert_eq!(rows, expected, "dead-lettered on the first attempt");
    assert_eq!(
        handler.0.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "no message had a second attempt"
    );
}
