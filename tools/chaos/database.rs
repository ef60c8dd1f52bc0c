//! The scratch database made for one broker's run, and what the ledger has finished in it.

use anyhow::Context as _;
use txinbox::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use txinbox::sqlx::{self, ConnectOptions as _, Executor as _, PgPool};

/// A database made for one broker's run.
pub(crate) struct Database {
    pub(crate) admin: PgConnectOptions,
    pub(crate) name: String,
    pub(crate) url: String,
    pub(crate) pool: PgPool,
}

impl Database {
    pub(crate) async fn create(admin_url: &str, name: &str) -> anyhow::Result<Database> {
        let admin: PgConnectOptions = admin_url.parse().context(
            "--database-url / DATABASE_URL does not parse; expected postgres://user@host:port/database",
        )?;
        let mut conn = admin
            .connect()
            .await
            .context("connecting to PostgreSQL failed; check --database-url / DATABASE_URL")?;
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .with_context(|| format!("creating database {name} (the role needs CREATEDB)"))?;
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(admin.clone().database(name))
            .await?;
        Ok(Database {
            url: txinbox_demos::with_database(admin_url, name),
            name: name.to_owned(),
            admin,
            pool,
        })
    }

    /// Distinct events the ledger has finished: applied, or dead-lettered. 0 until the first
    /// ledger has created its tables.
    pub(crate) async fn finished(&self) -> u64 {
        sqlx::query_scalar::<_, i64>(
            "SELECT (SELECT count(DISTINCT event_id) FROM ledger_entries)
                  + (SELECT count(DISTINCT message_id) FROM txinbox.dead_letters)",
        )
        .fetch_one(&self.pool)
        .await
        .map(|n| n as u64)
        .unwrap_or(0)
    }

    pub(crate) async fn drop_database(self) -> anyhow::Result<()> {
        self.pool.close().await;
        let mut conn = self.admin.connect().await?;
        conn.execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .await?;
        Ok(())
    }
}
