//! The router picks the handler by type and dead-letters what it cannot route.

use bytes::Bytes;
use txinbox::memory::MemoryBroker;
use txinbox::{message::Headers, Consumer};

use super::support::{deposit_in_lane, DepositHandler, TestDb};

#[tokio::test]
async fn a_router_picks_the_handler_by_type_and_dead_letters_what_it_cannot_route() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    let typed = |t: &str| Headers::new().with("ce_type", t.to_owned());
    let payload = |amount| Bytes::from(deposit_in_lane("alice", amount, "-", 0));
    broker.publish_with(None, Some("e1".into()), typed("deposit"), payload(5));
    broker.publish_with(None, Some("e2".into()), typed("refund"), payload(3));
    broker.publish_with(None, Some("e3".into()), typed("mystery"), payload(1));
    broker.close();
    let (deposits, refunds) = (DepositHandler::default(), DepositHandler::default());
    let router = txinbox::Router::new()
        .on_type("deposit", deposits.clone())
        .on_type("refund", refunds.clone());
    Consumer::builder("router")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(router)
        // One transaction per message: a batch with e3 in it would be re-run without it, and
        // run its neighbours' handlers twice (committed once); these counts are the routing's.
        .batch_size(1)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!((deposits.calls(), refunds.calls()), (1, 1));
    let (id, reason): (String, String) =
        sqlx::query_as("SELECT message_id, reason FROM txinbox.dead_letters")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((id.as_str(), reason.as_str()), ("e3", "no_handler"));
}
