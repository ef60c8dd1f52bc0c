//! Shared support: a scratch database, a recording publisher that fails on request, and the
//! relay helpers the tests use.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::PgPool;
use txinbox::outbox::{self, OutboxMessage, PublishError, Publisher, Relay, RelayConfig};
use txinbox::{async_trait, RetryPolicy};
use txinbox_testing::database::TestDatabase;

pub async fn test_db() -> PgPool {
    TestDatabase::builder("txinbox_outbox_t")
        .max_connections(12)
        .create()
        .await
        .pool()
        .clone()
}

/// Stands in for a broker: records every confirmed message in confirmation order, with the
/// relay that sent it; fails messages whose ID is in `failing` (transiently, `n` times, or
/// permanently).
#[derive(Clone, Default)]
pub struct Recorder {
    pub relay: &'static str,
    pub log: Arc<Mutex<Vec<(&'static str, OutboxMessage)>>>,
    pub failing: Arc<Mutex<HashMap<String, Failure>>>,
    pub jitter: bool,
    pub pause: Duration,
}

#[derive(Clone, Copy)]
pub enum Failure {
    Times(u32),
    Permanent,
}

impl Recorder {
    pub fn as_relay(&self, relay: &'static str) -> Recorder {
        Recorder {
            relay,
            ..self.clone()
        }
    }

    pub fn ids(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .map(|(_, m)| m.message_id().to_owned())
            .collect()
    }
}

#[async_trait]
impl Publisher for Recorder {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        tokio::time::sleep(self.pause).await;
        if self.jitter {
            tokio::time::sleep(Duration::from_micros(fastrand::u64(0..2000))).await;
        }
        if let Some(f) = self.failing.lock().unwrap().get_mut(message.message_id()) {
            match f {
                Failure::Permanent => return Err(PublishError::permanent("message too large")),
                Failure::Times(0) => {}
                Failure::Times(n) => {
                    *n -= 1;
                    return Err(PublishError::transient("broker unavailable"));
                }
            }
        }
        self.log.lock().unwrap().push((self.relay, message.clone()));
        Ok(())
    }
}

pub fn fast_config() -> RelayConfig {
    RelayConfig::default()
        .poll_interval(Duration::from_millis(50))
        .retry_policy(
            RetryPolicy::default()
                .max_attempts(3)
                .initial_delay(Duration::from_millis(1))
                .max_delay(Duration::from_millis(5)),
        )
}

pub async fn status_counts(pool: &PgPool) -> HashMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT status, count(*) FROM txinbox.outbox GROUP BY status")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

pub async fn drain<P: Publisher>(relay: &Relay<P>) {
    for _ in 0..1000 {
        let round = relay.relay_once().await.unwrap();
        if round.claimed == 0 {
            return;
        }
    }
    panic!("relay did not drain");
}

/// Writes `per_key` rows for each of `keys` keys, interleaved, each in its own transaction
/// (like a consumer processing one key after another).
pub async fn write_interleaved<DB: outbox::OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
    keys: usize,
    per_key: usize,
) -> usize
where
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    let mut n = 0;
    for i in 0..per_key {
        for k in 0..keys {
            let m =
                OutboxMessage::new(format!("k{k}-{i}"), "events", format!("{i}")).with_key(format!("k{k}"));
            assert!(outbox::write(pool, &m).await.unwrap());
            n += 1;
        }
    }
    // Some unkeyed rows too: they must be published, in any order.
    for i in 0..20 {
        outbox::write(pool, &OutboxMessage::new(format!("nokey-{i}"), "events", "x"))
            .await
            .unwrap();
        n += 1;
    }
    n
}

/// Every message of key `k` appears in the log in its write order, each exactly once.
pub fn assert_key_order(ids: &[String], keys: usize, per_key: usize) {
    let mut next = vec![0usize; keys];
    let mut seen = HashSet::new();
    for id in ids {
        assert!(seen.insert(id.clone()), "{id} published twice");
        if let Some(rest) = id.strip_prefix('k') {
            let (k, i) = rest.split_once('-').unwrap();
            let (k, i): (usize, usize) = (k.parse().unwrap(), i.parse().unwrap());
            assert_eq!(
                i, next[k],
                "key k{k}: message {i} published when {} was due",
                next[k]
            );
            next[k] += 1;
        }
    }
    assert!(
        next.iter().all(|n| *n == per_key),
        "every keyed row published: {next:?}"
    );
}

pub async fn scalar_i64(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

pub async fn scalar_text(pool: &PgPool, sql: &'static str) -> String {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Polls `relay`'s health until `pred` holds; panics with the last report after `within`.
pub async fn wait_relay(
    health: &txinbox::health::RelayHealth,
    within: Duration,
    what: &str,
    pred: impl Fn(&txinbox::health::RelayReport) -> bool,
) {
    let deadline = Instant::now() + within;
    loop {
        let report = health.report();
        if pred(&report) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: last report {report:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
