//! Shared test support: a fresh database per test with the deposit ledger's tables
//! (`txinbox_testing`), and a private PostgreSQL cluster that a test may stop and start
//! (`txinbox_testing::cluster`).

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use txinbox::memory::MemoryBroker;
use txinbox::{Consumer, RetryPolicy};

pub use txinbox_testing::cluster::PrivateCluster;
pub use txinbox_testing::database::server_url as admin_url;
use txinbox_testing::database::TestDatabase;
pub use txinbox_testing::ledger::{deposit_in_lane, DepositHandler};

/// A database created for one test, with txinbox migrated and the demo tables created.
pub struct TestDb {
    pub pool: PgPool,
    scratch: Option<TestDatabase>,
}

impl TestDb {
    pub async fn new(max_connections: u32) -> TestDb {
        let db = TestDatabase::builder("txinbox_t")
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(2))
            .create()
            .await;
        let mut this = Self::with_tables(db.pool().clone()).await;
        this.scratch = Some(db);
        this
    }

    /// The scratch database on the shared server (not for [`on`](Self::on)): to make it refuse
    /// connections or end its sessions.
    pub fn scratch(&self) -> &TestDatabase {
        self.scratch
            .as_ref()
            .expect("a scratch database on the shared server (TestDb::new)")
    }

    pub async fn on(options: PgConnectOptions, max_connections: u32) -> TestDb {
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(2))
            .connect_with(txinbox::PostgresInbox::connect_options(options))
            .await
            .expect("connect to the test database");
        txinbox::postgres::migrate(&pool).await.expect("migrate");
        Self::with_tables(pool).await
    }

    async fn with_tables(pool: PgPool) -> TestDb {
        txinbox_testing::ledger::create_tables(&pool).await;
        TestDb { pool, scratch: None }
    }

    pub fn inbox(&self) -> txinbox::PostgresInbox {
        txinbox::PostgresInbox::new(self.pool.clone())
    }

    pub async fn balance(&self, account: &str) -> i64 {
        sqlx::query_scalar("SELECT coalesce((SELECT balance FROM accounts WHERE id = $1), 0)")
            .bind(account)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn scalar(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.unwrap()
    }
}

pub fn fast_retries() -> RetryPolicy {
    RetryPolicy::default()
        .initial_delay(Duration::from_millis(5))
        .max_delay(Duration::from_millis(20))
}

/// Runs a consumer on `broker` until the broker is drained (the broker must be closed).
pub async fn drain(name: &str, db: &TestDb, broker: &MemoryBroker, handler: DepositHandler) {
    Consumer::builder(name)
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler)
        .retry_policy(fast_retries())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
}
