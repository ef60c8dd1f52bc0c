//! The consumer's own retention: [`Retention`], what
//! [`ConsumerBuilder::retention`](super::ConsumerBuilder::retention) takes, and the
//! [`Janitor`] it becomes when the consumer is built.

use std::time::Duration;

use crate::error::Error;
use crate::janitor::{Janitor, Schedule};
use crate::store::InboxStore;

/// How a consumer purges its own inbox: terminal rows older than the window, deleted by a
/// [janitor](crate::janitor) that runs beside the consumer and stops with it. Off unless
/// [`ConsumerBuilder::retention`](super::ConsumerBuilder::retention) is given one.
///
/// The same rows as `txinbox purge --older-than <window>` are deleted, with the same
/// statements, so the same rows are kept: `retrying` rows and rows at or after a stored
/// position (see [`ops::retention`](crate::ops::retention)). A `Duration` converts into one
/// with the default [`Schedule`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    window: Duration,
    force: bool,
    broker_retention: Option<Duration>,
    schedule: Schedule,
}

impl Retention {
    /// Purges terminal rows that became terminal more than `window` ago. A window shorter
    /// than the dedup window (7 days) is refused unless [`force`](Self::force)d.
    pub fn new(window: Duration) -> Self {
        Retention {
            window,
            force: false,
            broker_retention: None,
            schedule: Schedule::default(),
        }
    }

    /// Accepts a window shorter than the dedup window (7 days): a redelivery, replay or
    /// requeue of a message whose row is gone runs the handler again. Logged as a warning.
    pub fn force(mut self) -> Self {
        self.force = true;
        self
    }

    /// What the broker keeps (Kafka: the topic's `retention.ms`), so the consumer warns when
    /// the window is shorter: a replay could re-read messages whose rows are gone.
    pub fn broker_retention(mut self, retention: Duration) -> Self {
        self.broker_retention = Some(retention);
        self
    }

    /// How often and how fast rows are deleted. Default [`Schedule::default`]: a pass a minute,
    /// 1,000 rows per `DELETE`, 50 ms between them.
    pub fn schedule(mut self, schedule: Schedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// The window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Checks the window ([`ops::retention::check_window`](crate::ops::retention::check_window),
    /// the guard `txinbox purge` applies), logs its warnings, and builds the janitor on
    /// `store`'s database.
    pub(super) fn janitor<St: InboxStore>(self, consumer: &str, store: &St) -> Result<Janitor, Error> {
        #[cfg(feature = "postgres")]
        {
            let warnings =
                crate::ops::retention::check_window(self.window, self.force, self.broker_retention)
                    .map_err(|e| Error::Config(format!("{e} (Retention::force)")))?;
            for warning in warnings {
                tracing::warn!(%consumer, %warning, "inbox retention");
            }
            let pool = store.retention_pool().ok_or_else(|| {
                Error::Config(
                    "retention needs one of txinbox's stores (PostgresInbox or SqliteInbox): this store does not give the consumer its database to purge"
                        .into(),
                )
            })?;
            // Checked above, warnings logged.
            let sweep = crate::ops::retention::InboxSweep::forced(pool, consumer, self.window);
            Janitor::new(sweep, self.schedule, "inbox", Some(("consumer", consumer))).map_err(Error::Config)
        }
        #[cfg(not(feature = "postgres"))]
        {
            let _ = (consumer, store);
            Err(Error::Config(
                "retention needs txinbox's `postgres` feature (its purge statements live in txinbox::ops)"
                    .into(),
            ))
        }
    }
}

impl From<Duration> for Retention {
    fn from(window: Duration) -> Self {
        Retention::new(window)
    }
}
