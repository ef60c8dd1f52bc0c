//! Quorum queues: one declared beforehand is refused with the argument that differs and
//! consumed once the queue type says quorum; its delivery limit never drops a message behind
//! txinbox's back.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use txinbox::source::Settlement;
use txinbox::{Delivery, MessageSource};
use txinbox_amqp::{AmqpConfig, AmqpSource, QueueType};

use crate::support::{amqp_url, shared, unique};

async fn channel() -> (Connection, Channel) {
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect to AMQP_URL (scripts/test starts RabbitMQ)");
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    (conn, ch)
}

async fn declare(ch: &Channel, queue: &str, args: FieldTable) {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap_or_else(|e| panic!("declare {queue}: {e}"));
}

async fn publish(ch: &Channel, queue: &str, id: &str) {
    let confirm = ch
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            b"{}",
            BasicProperties::default()
                .with_message_id(id.into())
                .with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack(), "published {id}");
}

async fn ready(ch: &Channel, queue: &str) -> u32 {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("queue exists")
    .message_count()
}

async fn delete(ch: &Channel, queue: &str) {
    for q in [queue.to_owned(), format!("{queue}.retry"), format!("{queue}.dlq")] {
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

async fn next(source: &mut AmqpSource, within: Duration) -> Option<txinbox_amqp::AmqpDelivery> {
    tokio::time::timeout(within, source.receive())
        .await
        .ok()
        .map(|r| r.expect("receive").expect("source open"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queue_declared_beforehand_is_refused_naming_the_argument_then_consumed_as_quorum() {
    let _suite = shared().await;
    let queue = unique("declared-quorum");
    let (conn, ch) = channel().await;
    // As a team declares it: a quorum queue, nothing else.
    let mut quorum = FieldTable::default();
    quorum.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    declare(&ch, &queue, quorum).await;

    let err = AmqpSource::connect(AmqpConfig::new(amqp_url(), &queue))
        .await
        .expect_err("a classic declaration of a quorum queue is refused");
    let text = err.to_string();
    assert!(err.is_fatal(), "{text}");
    assert!(
        text.contains("inequivalent arg 'x-queue-type'") && text.contains("--amqp-queue-type quorum"),
        "the error names the argument and what to set: {text}"
    );

    let config = AmqpConfig::new(amqp_url(), &queue).queue_type(QueueType::Quorum);
    let mut source = AmqpSource::connect(config)
        .await
        .expect("consumes the quorum queue declared beforehand");
    publish(&ch, &queue, "q-1").await;
    let d = next(&mut source, Duration::from_secs(10))
        .await
        .expect("a delivery");
    assert_eq!(d.message().native_id(), Some("q-1"));
    d.settle(Settlement::Ack).await.unwrap();
    source.close().await.unwrap();
    assert_eq!(ready(&ch, &queue).await, 0);
    delete(&ch, &queue).await;
    let _ = conn.close(200, "done".into()).await;
}

/// A quorum queue gives a message back to the queue when its consumer dies or loses the
/// connection with it unacknowledged, counting `x-delivery-count`; past `x-delivery-limit` it
/// drops the message (no dead-letter exchange here). Every round below is such a loss. The
/// source replaces a delivery near the limit with a fresh copy, so the message outlives any
/// number of losses and leaves only when settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queue_never_drops_a_message_at_its_delivery_limit() {
    let _suite = shared().await;
    const LIMIT: u32 = 2;
    const ROUNDS: usize = 6;
    let queue = unique("delivery-limit");
    let config = AmqpConfig::new(amqp_url(), &queue)
        .queue_type(QueueType::Quorum)
        .delivery_limit(LIMIT)
        .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(500));
    let (conn, ch) = channel().await;
    for (name, args) in config.topology() {
        declare(&ch, &name, args).await;
    }
    publish(&ch, &queue, "fragile").await;

    for round in 1..=ROUNDS {
        let mut source = AmqpSource::connect(config.clone()).await.unwrap();
        let d = next(&mut source, Duration::from_secs(10)).await.unwrap_or_else(|| {
            panic!("round {round}: the message is gone: the broker dropped it at its delivery limit ({LIMIT})")
        });
        let count = d
            .message()
            .headers()
            .get_str("x-delivery-count")
            .map_or(0, |c| c.parse::<u32>().unwrap());
        assert!(
            count + 1 < LIMIT,
            "round {round}: a delivery with x-delivery-count {count} reached the handler; one more loss and the broker drops it"
        );
        // The consumer "dies" with the delivery unacknowledged.
        drop(d);
        source.close().await.unwrap();
    }

    // Still there. A copy may be there twice: when a consumer dies between a fresh copy's
    // confirm and the original's ack, both come back (at least once; the inbox takes one).
    let mut source = AmqpSource::connect(config.clone()).await.unwrap();
    let mut left = 0;
    let mut within = Duration::from_secs(10);
    while let Some(d) = next(&mut source, within).await {
        assert_eq!(d.message().native_id(), Some("fragile"));
        d.settle(Settlement::Ack).await.unwrap();
        left += 1;
        within = Duration::from_secs(1);
    }
    assert!(left >= 1, "the message is still there");
    source.close().await.unwrap();
    assert_eq!(ready(&ch, &queue).await, 0);
    assert_eq!(ready(&ch, &format!("{queue}.dlq")).await, 0);
    delete(&ch, &queue).await;
    let _ = conn.close(200, "done".into()).await;
}
