//! Outbox message IDs shared between consumers or taken by another message.

use std::sync::atomic::Ordering;

use txinbox::async_trait;
use txinbox::outbox::{self, OutboxMessage};

use crate::support::*;

/// Two consumers handle the same event and emit a message under the same step name. Their
/// derived IDs used to be equal (the consumer was not part of the derivation), so the second
/// consumer's outbox row was dropped by `ON CONFLICT DO NOTHING` and its message never sent.
#[tokio::test]
async fn two_consumers_emitting_the_same_step_for_one_event_both_publish() {
    use txinbox::memory::MemoryBroker;
    use txinbox::{Consumer, Context, Handler, HandlerError, Message};

    struct Notify;
    #[async_trait]
    impl Handler<sqlx::Postgres> for Notify {
        async fn handle(
            &self,
            cx: &mut Context<'_, sqlx::Postgres>,
            msg: &Message,
        ) -> Result<(), HandlerError> {
            let payload = format!("{} saw {}", cx.consumer(), String::from_utf8_lossy(msg.payload()));
            let event = OutboxMessage::new(cx.derive_id("notify"), "notifications", payload);
            assert!(cx.outbox(&event).await?, "a new row");
            Ok(())
        }
    }

    let pool = test_db().await;
    for consumer in ["billing", "shipping"] {
        let broker = MemoryBroker::new("orders");
        broker.publish("order-1", "placed");
        broker.close();
        Consumer::builder(consumer)
            .source(broker.source())
            .inbox(txinbox::PostgresInbox::new(pool.clone()))
            .handler(Notify)
            .build()
            .unwrap()
            .run()
            .await
            .unwrap();
        assert!(
            broker.dead_letters().is_empty(),
            "{consumer}: {:?}",
            broker.dead_letters()
        );
    }
    let rows: Vec<(String, Vec<u8>)> =
        sqlx::query_as("SELECT message_id, payload FROM txinbox.outbox ORDER BY payload")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        [
            (
                outbox::derive_id("billing", "order-1", "notify"),
                b"billing saw placed".to_vec()
            ),
            (
                outbox::derive_id("shipping", "order-1", "notify"),
                b"shipping saw placed".to_vec()
            ),
        ]
    );
}

/// A handler whose outbox message collides with another message's ID is dead-lettered at once
/// (permanent: writing it again cannot succeed), not retried until its attempts run out.
#[tokio::test]
async fn an_outbox_id_taken_by_another_message_dead_letters_the_incoming_one() {
    use std::sync::atomic::AtomicU32;
    use txinbox::memory::MemoryBroker;
    use txinbox::{dead_letter::DeadLetterReason, Consumer, Context, Handler, HandlerError, Message};

    #[derive(Clone, Default)]
    struct FixedId(std::sync::Arc<AtomicU32>);
    #[async_trait]
    impl Handler<sqlx::Postgres> for FixedId {
        async fn handle(
            &self,
            cx: &mut Context<'_, sqlx::Postgres>,
            msg: &Message,
        ) -> Result<(), HandlerError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            cx.outbox(&OutboxMessage::new("fixed", "t", msg.payload().clone()))
                .await?;
            Ok(())
        }
    }

    let pool = test_db().await;
    let broker = MemoryBroker::new("orders");
    broker.publish("a", "first");
    broker.publish("b", "second");
    broker.close();
    let handler = FixedId::default();
    Consumer::builder("fixed")
        .source(broker.source())
        .inbox(txinbox::PostgresInbox::new(pool.clone()))
        .handler(handler.clone())
        .batch_size(1)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!(handler.0.load(Ordering::SeqCst), 2, "each message ran once");
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.reason, DeadLetterReason::Permanent);
    assert!(dead[0].1.error.contains("another payload"), "{}", dead[0].1.error);
    assert_eq!(scalar_i64(&pool, "SELECT count(*) FROM txinbox.outbox").await, 1);
}
