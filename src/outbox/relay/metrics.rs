//! What a relay reports: its counters and the backlog gauges ([`Backlog`]).

use std::time::Duration;

use metrics::{Counter, Gauge};

use super::{OutboxPool, Relay};
use crate::outbox::Publisher;
use crate::telemetry;

/// The outbox's backlog, as the gauges report it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backlog {
    /// Rows with status `pending`.
    pub pending: i64,
    /// Age of the oldest pending row (zero when none).
    pub oldest_pending_age: Duration,
}

pub(super) struct Metrics {
    pub(super) published: Counter,
    pub(super) failures: Counter,
    pub(super) dead_letters: Counter,
    pub(super) pending: Gauge,
    pub(super) oldest_age: Gauge,
}

impl Metrics {
    pub(super) fn new(relay: &str) -> Self {
        use metrics::{describe_counter, describe_gauge, Unit};
        describe_gauge!(telemetry::OUTBOX_PENDING, "Outbox rows waiting to be published");
        describe_gauge!(
            telemetry::OUTBOX_OLDEST_PENDING_AGE,
            Unit::Seconds,
            "Age of the oldest pending outbox row"
        );
        describe_counter!(telemetry::OUTBOX_PUBLISHED, "Outbox rows published and marked");
        describe_counter!(
            telemetry::OUTBOX_PUBLISH_FAILURES,
            "Outbox publish attempts not confirmed by the broker"
        );
        describe_counter!(telemetry::OUTBOX_DEAD_LETTERS, "Outbox rows dead-lettered");
        let label = || [("relay", relay.to_owned())];
        Metrics {
            published: metrics::counter!(telemetry::OUTBOX_PUBLISHED, &label()),
            failures: metrics::counter!(telemetry::OUTBOX_PUBLISH_FAILURES, &label()),
            dead_letters: metrics::counter!(telemetry::OUTBOX_DEAD_LETTERS, &label()),
            pending: metrics::gauge!(telemetry::OUTBOX_PENDING, &label()),
            oldest_age: metrics::gauge!(telemetry::OUTBOX_OLDEST_PENDING_AGE, &label()),
        }
    }
}

impl<P: Publisher> Relay<P> {
    /// Counts pending rows and the age of the oldest, and sets the gauges.
    pub async fn refresh_metrics(&self) -> Result<Backlog, sqlx::Error> {
        let (pending, age) = match &self.pool {
            #[cfg(feature = "postgres")]
            OutboxPool::Postgres(pool) => crate::outbox::postgres::backlog(pool).await?,
            #[cfg(feature = "sqlite")]
            OutboxPool::Sqlite(pool) => crate::outbox::sqlite::backlog(pool).await?,
        };
        self.metrics.pending.set(pending as f64);
        self.metrics.oldest_age.set(age);
        Ok(Backlog {
            pending,
            oldest_pending_age: Duration::from_secs_f64(age.max(0.0)),
        })
    }
}
