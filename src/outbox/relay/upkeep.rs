//! What runs between rounds, each on its schedule: retention (deleting old published rows) and
//! the refresh of the backlog gauges.

use std::time::Instant;

use super::{OutboxPool, Relay};
use crate::outbox::Publisher;

impl<P: Publisher> Relay<P> {
    /// Refreshes the gauges and runs retention, each if its interval has passed.
    pub(super) async fn run_due_upkeep(&self, last_metrics: &mut Instant, last_purge: &mut Instant) {
        if last_metrics.elapsed() >= self.config.metrics_interval {
            *last_metrics = Instant::now();
            if let Err(e) = self.refresh_metrics().await {
                tracing::debug!(relay = %self.config.name, error = %e, "outbox backlog query failed");
            }
        }
        if last_purge.elapsed() >= self.config.retention_interval {
            *last_purge = Instant::now();
            if let Err(e) = self.purge_published().await {
                tracing::warn!(relay = %self.config.name, error = %e, "outbox retention failed; retrying on schedule");
            }
        }
    }

    /// Deletes published rows older than the retention window, in batches of the configured
    /// size. Returns how many were deleted.
    pub async fn purge_published(&self) -> Result<u64, sqlx::Error> {
        let (retention, batch) = (self.config.retention, self.config.retention_batch);
        let mut total = 0;
        loop {
            let deleted = match &self.pool {
                #[cfg(feature = "postgres")]
                OutboxPool::Postgres(pool) => {
                    crate::outbox::postgres::purge(pool, retention.as_secs_f64(), batch).await?
                }
                #[cfg(feature = "sqlite")]
                OutboxPool::Sqlite(pool) => {
                    crate::outbox::sqlite::purge_published(pool, retention, batch).await?
                }
            };
            total += deleted;
            if deleted < self.config.retention_batch as u64 {
                return Ok(total);
            }
        }
    }
}
