//! The service's handler alone, with txinbox's handler harness on a scratch PostgreSQL database
//! (`DATABASE_URL`): the README's "Testing your handler" is this test.

use txinbox::sqlx;
use txinbox::testing::{HandlerTest, Outcome};
use txinbox_service::Deposits;
use txinbox_testing::database::TestDatabase;

#[tokio::test]
async fn a_deposit_credits_once_and_announces_it() -> Result<(), txinbox::Error> {
    let db = TestDatabase::builder("service_handler")
        .migrate(false)
        .create()
        .await;
    let handler = Deposits {
        events_topic: "deposits.applied".into(),
    };
    let test = HandlerTest::postgres(db.url(), handler).await?;
    txinbox_service::migrate(test.pool()).await?;

    let deposit = test.message("deposit-1", r#"{"account": "alice", "amount": 250}"#);
    assert_eq!(
        test.deliver(deposit.clone()).await?,
        Outcome::Applied { attempt: 1 }
    );
    assert_eq!(test.deliver(deposit).await?, Outcome::Duplicate);
    let negative = test.message("deposit-2", r#"{"account": "alice", "amount": -5}"#);
    assert!(test.deliver(negative).await?.is_dead_lettered("permanent_error"));
    let garbage = test.message("deposit-3", "not json");
    assert!(test.deliver(garbage).await?.is_dead_lettered("undecodable"));

    let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = 'alice'")
        .fetch_one(test.pool())
        .await?;
    assert_eq!(balance, 250);
    let events: Vec<(String, Vec<u8>)> = sqlx::query_as("SELECT destination, payload FROM txinbox.outbox")
        .fetch_all(test.pool())
        .await?;
    assert_eq!(events.len(), 1, "one event, for the applied deposit");
    assert_eq!(events[0].0, "deposits.applied");
    let event: serde_json::Value = serde_json::from_slice(&events[0].1).unwrap();
    assert_eq!(event["balance"], 250);
    drop(test);
    db.drop_database().await;
    Ok(())
}
