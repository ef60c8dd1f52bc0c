//! What runs beside the rounds: retention (deleting old published rows: an [`OutboxSweep`] run
//! by a [`Janitor`](crate::janitor::Janitor) on its own task) and, between rounds, the refresh
//! of the backlog gauges.

use std::time::{Duration, Instant};

use super::{OutboxPool, Relay};
use crate::outbox::Publisher;

/// The outbox's published rows as a [`Sweep`](crate::janitor::Sweep): rows published more
/// than the retention window ago, oldest first; pending and dead-lettered rows are never
/// deleted. Its oldest-row clock is `published_at`.
#[derive(Debug)]
pub(super) struct OutboxSweep {
    pub(super) pool: OutboxPool,
    pub(super) retention: Duration,
}

#[async_trait::async_trait]
impl crate::janitor::Sweep for OutboxSweep {
    async fn delete_batch(&self, batch: u32) -> Result<u64, sqlx::Error> {
        match &self.pool {
            #[cfg(feature = "postgres")]
            OutboxPool::Postgres(pool) => {
                crate::outbox::postgres::purge(pool, self.retention.as_secs_f64(), batch as usize).await
            }
            #[cfg(feature = "sqlite")]
            OutboxPool::Sqlite(pool) => {
                crate::outbox::sqlite::purge_published(pool, self.retention, batch as usize).await
            }
        }
    }

    async fn oldest_age(&self) -> Result<Option<Duration>, sqlx::Error> {
        let seconds = match &self.pool {
            #[cfg(feature = "postgres")]
            OutboxPool::Postgres(pool) => crate::outbox::postgres::oldest_published_age(pool).await?,
            #[cfg(feature = "sqlite")]
            OutboxPool::Sqlite(pool) => crate::outbox::sqlite::oldest_published_age(pool).await?,
        };
        Ok(seconds.map(|s| Duration::from_secs_f64(s.max(0.0))))
    }
}

impl<P: Publisher> Relay<P> {
    /// Refreshes the gauges if their interval has passed.
    pub(super) async fn run_due_upkeep(&self, last_metrics: &mut Instant) {
        if last_metrics.elapsed() >= self.config.metrics_interval {
            *last_metrics = Instant::now();
            if let Err(e) = self.refresh_metrics().await {
                tracing::debug!(relay = %self.config.name, error = %e, "outbox backlog query failed");
            }
        }
    }

    /// Deletes published rows older than the retention window now, in batches of the
    /// configured size (one pass of the relay's retention janitor, which
    /// [`run_until`](Self::run_until) also runs on its schedule). Returns how many were deleted.
    pub async fn purge_published(&self) -> Result<u64, sqlx::Error> {
        self.janitor.pass().await
    }
}
