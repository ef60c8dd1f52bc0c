//! Configuration errors say what to change.

use txinbox::memory::MemoryBroker;
use txinbox::{Consumer, Error, IdStrategy};

use super::support::DepositHandler;

#[tokio::test]
async fn configuration_errors_say_what_to_change() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy(&super::support::admin_url())
        .unwrap();
    let build = |name: &str, concurrency: usize, id: IdStrategy| {
        Consumer::builder(name)
            .source(MemoryBroker::new("q").source())
            .inbox(txinbox::PostgresInbox::new(pool.clone()))
            .handler(DepositHandler::default())
            .concurrency(concurrency)
            .id_strategy(id)
            .build()
            .unwrap_err()
    };
    let msg = |e: Error| e.to_string();
    assert!(msg(build("bad name; DROP", 1, IdStrategy::Native)).contains("use only A-Z a-z 0-9"));
    assert!(msg(build("", 1, IdStrategy::Native)).contains("1 to 128"));
    assert!(msg(build("ok", 9, IdStrategy::Native)).contains("raise max_connections or lower concurrency"));
    assert!(msg(build("ok", 1, IdStrategy::JsonPointer("id".into()))).contains("start with '/'"));
    let bad_url = txinbox::PostgresInbox::connect("postgres://user:s3cret@127.0.0.1:1/db", 2)
        .await
        .unwrap_err();
    assert!(
        !bad_url.to_string().contains("s3cret"),
        "secrets never appear in errors: {bad_url}"
    );
    let unparsable = txinbox::PostgresInbox::connect("not a url", 2).await.unwrap_err();
    assert!(unparsable.to_string().contains("does not parse"), "{unparsable}");
}
