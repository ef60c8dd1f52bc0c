//! Migrations: a fresh install, a rerun, and the application's own migrations beside txinbox's;
//! a consumer on an unmigrated database stops with an error that says to migrate.

use txinbox::memory::MemoryBroker;
use txinbox::Consumer;

use super::support::{deposit_in_lane, DepositHandler, TestDb};

#[tokio::test]
async fn fresh_install_rerun_and_coexistence_with_the_applications_migrations() {
    let db = TestDb::new(10).await; // fresh database, txinbox migrated once
    let ledger = "SELECT count(*) FROM txinbox._sqlx_migrations";
    let applied = db.scalar(ledger).await;
    assert!(applied >= 1);
    txinbox::postgres::migrate(&db.pool)
        .await
        .expect("re-running is a no-op");
    assert_eq!(db.scalar(ledger).await, applied);

    // The application's own sqlx migrations, in the default public ledger.
    let dir = std::env::temp_dir().join(format!("txinbox-app-migrations-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("1_app.sql"),
        "CREATE TABLE app_orders (id bigint PRIMARY KEY);",
    )
    .unwrap();
    let app = sqlx::migrate::Migrator::new(dir.as_path()).await.unwrap();
    app.run(&db.pool).await.expect("the app migrates beside txinbox");
    txinbox::postgres::migrate(&db.pool)
        .await
        .expect("txinbox still migrates after the app");
    app.run(&db.pool)
        .await
        .expect("the app's migrator does not trip over txinbox's ledger");
    assert_eq!(db.scalar("SELECT count(*) FROM public._sqlx_migrations").await, 1);
    assert_eq!(db.scalar(ledger).await, applied);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn a_missing_schema_stops_the_consumer_with_a_clear_error() {
    let db = TestDb::new(10).await;
    sqlx::query("DROP SCHEMA txinbox CASCADE")
        .execute(&db.pool)
        .await
        .unwrap();
    let broker = MemoryBroker::new("q");
    broker.publish("evt-1", deposit_in_lane("alice", 1, "-", 0));
    let err = Consumer::builder("nomigrate")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("run txinbox::postgres::migrate"),
        "{err}"
    );
    assert_eq!(broker.stats().acked, 0);
    assert_eq!(broker.pending(), 1, "the message is still there");
}
