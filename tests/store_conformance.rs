//! Runs the `InboxStore` conformance suite (`txinbox_testing::conformance::store`) against
//! every store of this crate: PostgreSQL (needs `DATABASE_URL`, a role that may create
//! databases) and SQLite (a temporary file). A third-party store runs the same functions (`retention` if it supports the consumer's retention).

use std::sync::Arc;

use txinbox_testing::conformance::store::{batches, contract, duplicates, retention, subscriptions};

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_conforms() {
    let db = txinbox_testing::database::TestDatabase::builder("txinbox_conformance")
        .max_connections(5)
        .create()
        .await;
    let pool = db.pool().clone();
    let count_pool = pool.clone();
    contract(
        Arc::new(txinbox::PostgresInbox::new(pool.clone())),
        move |reason| {
            let pool = count_pool.clone();
            async move {
                sqlx::query_scalar("SELECT count(*) FROM txinbox.dead_letters WHERE reason = $1")
                    .bind(reason)
                    .fetch_one(&pool)
                    .await
                    .unwrap()
            }
        },
    )
    .await;
    batches(Arc::new(txinbox::PostgresInbox::new(pool.clone()))).await;
    subscriptions(Arc::new(txinbox::PostgresInbox::new(pool.clone()))).await;
    retention(Arc::new(txinbox::PostgresInbox::new(pool.clone()))).await;
    let read_pool = pool.clone();
    duplicates(Arc::new(txinbox::PostgresInbox::new(pool.clone())), move |id| {
        let pool = read_pool.clone();
        async move {
            sqlx::query_scalar(
                "SELECT duplicates FROM txinbox.inbox WHERE consumer = 'dups' AND message_id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    })
    .await;
    pool.close().await;
    db.drop_database().await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store_conforms() {
    let dir = std::env::temp_dir().join(format!("txinbox-conformance-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let store = txinbox::SqliteInbox::open(dir.join("inbox.db"), 4).await.unwrap();
    txinbox::sqlite::migrate(store.pool()).await.unwrap();
    txinbox::sqlite::migrate(store.pool())
        .await
        .expect("re-running is a no-op");
    let pool = store.pool().clone();
    contract(Arc::new(store.clone()), move |reason| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar("SELECT count(*) FROM txinbox_dead_letters WHERE reason = ?1")
                .bind(reason)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    })
    .await;
    let read_pool = store.pool().clone();
    duplicates(Arc::new(store.clone()), move |id| {
        let pool = read_pool.clone();
        async move {
            sqlx::query_scalar(
                "SELECT duplicates FROM txinbox_inbox WHERE consumer = 'dups' AND message_id = ?1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    })
    .await;
    subscriptions(Arc::new(store.clone())).await;
    retention(Arc::new(store.clone())).await;
    batches(Arc::new(store)).await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// A COMMIT must be durable before the broker is acknowledged: SQLite below `synchronous =
/// FULL` is reported (the PostgreSQL side is tested with a running consumer in
/// `tests/postgres/store_health.rs`).
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_preflight_reports_a_commit_that_is_not_durable() {
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions, SqliteSynchronous};
    use txinbox::InboxStore as _;
    let dir = std::env::temp_dir().join(format!("txinbox-preflight-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("inbox.db");
    let durable = txinbox::SqliteInbox::open(&path, 2).await.unwrap();
    assert!(durable.preflight().await.unwrap().is_empty());
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .synchronous(SqliteSynchronous::Normal);
    let pool = SqlitePoolOptions::new().connect_with(options).await.unwrap();
    let warnings = txinbox::SqliteInbox::new(pool).preflight().await.unwrap();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("synchronous is 1"), "{warnings:?}");
    std::fs::remove_dir_all(dir).unwrap();
}
