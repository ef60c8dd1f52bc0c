//! How a [`Relay`](super::Relay) is configured: [`RelayConfig`], its defaults and checks, and
//! [`RelayError`].

use std::fmt;
use std::time::Duration;

use crate::retry::RetryPolicy;

/// How a [`Relay`](super::Relay) runs. Every field has a default; see each setter.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    pub(super) name: String,
    pub(super) batch_size: usize,
    pub(super) poll_interval: Duration,
    pub(super) publish_timeout: Duration,
    pub(super) retry: RetryPolicy,
    pub(super) retention: Duration,
    pub(super) retention_interval: Duration,
    pub(super) retention_batch: usize,
    pub(super) metrics_interval: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            name: "outbox".into(),
            batch_size: 256,
            poll_interval: Duration::from_secs(1),
            publish_timeout: Duration::from_secs(20),
            retry: RetryPolicy::default()
                .max_attempts(20)
                .initial_delay(Duration::from_millis(500))
                .max_delay(Duration::from_secs(60)),
            retention: Duration::from_secs(24 * 3600),
            retention_interval: Duration::from_secs(60),
            retention_batch: 1000,
            metrics_interval: Duration::from_secs(5),
        }
    }
}

impl RelayConfig {
    /// The relay's name, the `relay` label of its metrics. Default `outbox`.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Most rows claimed (and published) per transaction. Default 256.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// How often the relay looks for due rows without a notification: the fallback when a
    /// `NOTIFY` is lost (listener reconnect) and the clock for retries coming due. Default 1 s.
    /// On SQLite, which has no notifications, this is how long a new row can wait.
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// Longest wait for one broker confirmation before it counts as a failed attempt, and
    /// how long a round keeps starting new publishes (rows not started by then wait for the
    /// next round, no attempt counted). Default 20 s. The claim transaction stays open while
    /// publishing — up to twice this — so keep twice this below the pool's
    /// `idle_in_transaction_session_timeout` (60 s with `PostgresInbox::connect_options`).
    /// A round the server cuts off is not lost: its rows are published again. On SQLite a
    /// round's claim (its lease) lasts twice this plus 10 s.
    pub fn publish_timeout(mut self, d: Duration) -> Self {
        self.publish_timeout = d;
        self
    }

    /// Attempts and backoff per row. Default 20 attempts, 500 ms initial delay, 60 s maximum.
    /// A row whose attempts are exhausted is dead-lettered (status `dead_lettered`, with its
    /// last error), which lets the later rows of its key go.
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// How long published rows are kept before retention deletes them. Default 24 h.
    /// Dead-lettered rows are never deleted by the relay.
    pub fn retention(mut self, d: Duration) -> Self {
        self.retention = d;
        self
    }

    /// How often retention runs, and how many rows one `DELETE` removes. Defaults 60 s, 1000.
    /// Retention is a [janitor](crate::janitor) on its own task while the relay runs: batches
    /// are [`DEFAULT_PAUSE`](crate::janitor::DEFAULT_PAUSE) apart, and its metrics are the
    /// `txinbox_retention_*` ones with `table="outbox"` and the `relay` label.
    pub fn retention_schedule(mut self, every: Duration, batch: usize) -> Self {
        self.retention_interval = every;
        self.retention_batch = batch;
        self
    }

    /// How often the pending-rows gauges are refreshed. Default 5 s.
    pub fn metrics_interval(mut self, d: Duration) -> Self {
        self.metrics_interval = d;
        self
    }

    pub(super) fn validate(&self) -> Result<(), String> {
        if self.batch_size == 0 || self.batch_size > 10_000 {
            return Err(format!(
                "RelayConfig::batch_size is {}; use 1..=10000",
                self.batch_size
            ));
        }
        if self.retention_batch == 0 {
            return Err("RelayConfig::retention_schedule batch must be at least 1".into());
        }
        for (what, d) in [
            ("poll_interval", self.poll_interval),
            ("publish_timeout", self.publish_timeout),
            ("retention_schedule interval", self.retention_interval),
            ("metrics_interval", self.metrics_interval),
        ] {
            if d.is_zero() {
                return Err(format!("RelayConfig::{what} must be above zero"));
            }
        }
        self.retry.validate()
    }
}

/// Why a relay could not start or had to stop.
#[derive(Debug)]
#[non_exhaustive]
pub enum RelayError {
    /// The configuration is invalid; the message says what to change.
    Config(String),
}

impl fmt::Display for RelayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RelayError::Config(m) => write!(f, "invalid relay configuration: {m}"),
        }
    }
}

// No cause: a configuration error is its own text.
impl std::error::Error for RelayError {}
