//! A model-based test of micro-batching: random scenarios of lanes holding new, duplicate,
//! conflicting, transiently failing, permanently failing, panicking, lock-contended and
//! undecodable messages, run through a consumer with a random batch size, concurrency, linger,
//! batch handler or not, and broker faults (duplicate deliveries, lost acks), then checked
//! against a model of what must be committed and dead-lettered:
//!
//! - every message that can succeed has its effect exactly once, nothing else has one;
//! - a message that cannot succeed has exactly one dead letter with its reason, and every
//!   delivery of it went to the broker's dead letters, none was acknowledged;
//! - a conflicting payload is dead-lettered (once in the database) and never runs the handler;
//! - a lock conflict never spends an attempt (a message contended more often than it has
//!   attempts still succeeds);
//! - every delivery is settled.
//!
//! `PROPTEST_CASES` sets the number of scenarios (default 12 here, to keep CI short); a
//! failure prints the shrunk scenario and its seed.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;
use txinbox::memory::MemoryBroker;
use txinbox::{
    handler::BatchContext, handler::BatchHandler, handler::BatchMessage, Consumer, Context, Handler,
    HandlerError, Message,
};

use super::support::{fast_retries, TestDb};

const MAX_ATTEMPTS: u32 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
enum Kind {
    Ok,
    /// Fails transiently on attempts `1..=n` (n < MAX_ATTEMPTS): succeeds.
    Transient(u32),
    /// Fails transiently on every attempt: dead-lettered `attempts_exhausted`.
    Forever,
    /// Dead-lettered `permanent_error` at once.
    Permanent,
    /// Panics on attempt 1: treated as transient, succeeds on attempt 2.
    Panic,
    /// Loses a lock conflict on its first `n` runs (n may exceed MAX_ATTEMPTS): succeeds.
    Contended(u32),
    /// Not JSON: dead-lettered `undecodable`.
    Undecodable,
}

impl Kind {
    fn dead_letter_reason(self) -> Option<&'static str> {
        match self {
            Kind::Forever => Some("attempts_exhausted"),
            Kind::Permanent => Some("permanent_error"),
            Kind::Undecodable => Some("undecodable"),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
struct Scenario {
    kinds: Vec<Kind>,
    /// (event, variant): variant 0 is the event's payload, 1 another payload under its ID.
    /// Each lane lists its deliveries in order; an event's first delivery is its variant 0.
    lanes: Vec<Vec<(usize, u8)>>,
    batch_size: usize,
    concurrency: usize,
    linger_ms: u64,
    batch_handler: bool,
    duplicates: f64,
    lost_acks: f64,
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        4 => Just(Kind::Ok),
        1 => (1..MAX_ATTEMPTS).prop_map(Kind::Transient),
        1 => Just(Kind::Forever),
        1 => Just(Kind::Permanent),
        1 => Just(Kind::Panic),
        1 => (1..=MAX_ATTEMPTS + 2).prop_map(Kind::Contended),
        1 => Just(Kind::Undecodable),
    ]
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        prop::collection::vec(kind(), 1..40),
        1usize..=4,
        prop::collection::vec((any::<prop::sample::Index>(), 0u8..=1), 0..20),
        1usize..=30,
        1usize..=4,
        prop_oneof![Just(0u64), Just(3u64)],
        any::<bool>(),
        prop_oneof![Just(0.0), Just(0.15)],
        prop_oneof![Just(0.0), Just(0.15)],
    )
        .prop_map(
            |(
                kinds,
                lanes,
                extra,
                batch_size,
                concurrency,
                linger_ms,
                batch_handler,
                duplicates,
                lost_acks,
            )| {
                // Each event lives in one lane (its index modulo the lane count), in order;
                // duplicates and conflicting copies follow later in the same lane.
                let mut lane_of = Vec::new();
                let mut per_lane = vec![Vec::new(); lanes];
                for event in 0..kinds.len() {
                    lane_of.push(event % lanes);
                    per_lane[event % lanes].push((event, 0u8));
                }
                for (pick, variant) in extra {
                    let event = pick.index(kinds.len());
                    per_lane[lane_of[event]].push((event, variant));
                }
                Scenario {
                    kinds,
                    lanes: per_lane,
                    batch_size,
                    concurrency,
                    linger_ms,
                    batch_handler,
                    duplicates,
                    lost_acks,
                }
            },
        )
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Event {
    event: usize,
    kind: Kind,
    variant: u8,
}

fn payload(s: &Scenario, event: usize, variant: u8) -> Bytes {
    match s.kinds[event] {
        Kind::Undecodable => format!("garbage:{event}:{variant}").into(),
        kind => serde_json::to_vec(&Event { event, kind, variant })
            .unwrap()
            .into(),
    }
}

/// Applies events as the model says: the effect is a row per application.
#[derive(Clone, Default)]
struct ModelHandler {
    batch: bool,
    /// Runs per message ID, for lock conflicts (not attempts: those do not count them).
    runs: Arc<Mutex<HashMap<String, u32>>>,
}

impl ModelHandler {
    async fn apply(
        &self,
        conn: &mut sqlx::PgConnection,
        consumer: &str,
        msg: &Message,
        id: &str,
        attempt: u32,
    ) -> Result<(), HandlerError> {
        let event: Event = msg.json()?;
        let run = {
            let mut runs = self.runs.lock().unwrap();
            let n = runs.entry(id.to_owned()).or_default();
            *n += 1;
            *n
        };
        match event.kind {
            Kind::Transient(n) if attempt <= n => return Err(HandlerError::transient("flaky")),
            Kind::Forever => return Err(HandlerError::transient("always down")),
            Kind::Permanent => return Err(HandlerError::permanent("invalid business data")),
            Kind::Panic if attempt == 1 => panic!("handler bug on attempt 1"),
            Kind::Contended(n) if run <= n => {
                sqlx::query("DO $$ BEGIN RAISE EXCEPTION 'lock conflict' USING ERRCODE = '40P01'; END $$")
                    .execute(&mut *conn)
                    .await?;
            }
            _ => {}
        }
        sqlx::query("INSERT INTO model_effects (consumer, message_id, variant) VALUES ($1, $2, $3)")
            .bind(consumer)
            .bind(id)
            .bind(event.variant as i32)
            .execute(conn)
            .await?;
        Ok(())
    }
}

#[txinbox::async_trait]
impl Handler<sqlx::Postgres> for ModelHandler {
    async fn handle(&self, cx: &mut Context<'_, sqlx::Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let (consumer, id, attempt) = (
            cx.consumer().to_owned(),
            cx.message_id().as_str().to_owned(),
            cx.attempt(),
        );
        self.apply(cx.db(), &consumer, msg, &id, attempt).await
    }
    fn batch(&self) -> Option<&dyn BatchHandler<sqlx::Postgres>> {
        self.batch.then_some(self as &dyn BatchHandler<sqlx::Postgres>)
    }
}

#[txinbox::async_trait]
impl BatchHandler<sqlx::Postgres> for ModelHandler {
    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, sqlx::Postgres>,
        batch: &[BatchMessage<'_>],
    ) -> Result<(), HandlerError> {
        // Applies the batch message by message on its transaction: any failure fails the whole
        // batch, which the runtime then runs message by message through `handle`.
        let consumer = cx.consumer().to_owned();
        for m in batch {
            self.apply(cx.db(), &consumer, m.message(), m.id().as_str(), m.attempt())
                .await?;
        }
        Ok(())
    }
}

async fn check(db: &TestDb, case: usize, s: &Scenario) -> Result<(), TestCaseError> {
    let consumer = format!("model-{case}");
    let broker = MemoryBroker::new("model");
    broker.set_duplicate_probability(s.duplicates);
    broker.set_lose_ack_probability(s.lost_acks);
    // Interleave the lanes' deliveries: each lane keeps its order.
    let mut cursors = vec![0; s.lanes.len()];
    loop {
        let mut published = false;
        for (lane, deliveries) in s.lanes.iter().enumerate() {
            if let Some(&(event, variant)) = deliveries.get(cursors[lane]) {
                cursors[lane] += 1;
                published = true;
                broker.publish_in_lane(
                    &format!("lane-{lane}"),
                    format!("e{event}"),
                    payload(s, event, variant),
                );
            }
        }
        if !published {
            break;
        }
    }
    broker.close();
    broker.record_acks();
    let handler = ModelHandler {
        batch: s.batch_handler,
        ..Default::default()
    };
    let run = Consumer::builder(&consumer)
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler)
        .retry_policy(fast_retries().max_attempts(MAX_ATTEMPTS))
        .batch_size(s.batch_size)
        .concurrency(s.concurrency)
        .batch_linger(Duration::from_millis(s.linger_ms))
        .build()
        .unwrap()
        .run();
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .map_err(|_| TestCaseError::fail("the consumer did not settle everything within 60 s"))?
        .unwrap();

    // The model.
    let conflicted: Vec<usize> = {
        let mut v: Vec<usize> = s
            .lanes
            .iter()
            .flatten()
            .filter(|(_, v)| *v == 1)
            .map(|(e, _)| *e)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let mut want_effects = BTreeMap::new();
    let mut want_dead = BTreeMap::new();
    for (event, kind) in s.kinds.iter().enumerate() {
        match kind.dead_letter_reason() {
            None => {
                want_effects.insert(format!("e{event}"), 1i64);
            }
            Some(reason) => {
                want_dead.insert((format!("e{event}"), reason.to_owned()), 1i64);
            }
        }
    }
    for event in &conflicted {
        want_dead.insert((format!("e{event}"), "conflict".to_owned()), 1);
    }

    let effects: BTreeMap<String, i64> = sqlx::query_as(
        "SELECT message_id, count(*) FROM model_effects WHERE consumer = $1 GROUP BY message_id",
    )
    .bind(&consumer)
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    prop_assert_eq!(
        &effects,
        &want_effects,
        "effects: exactly once for what can succeed"
    );
    let variants: i64 =
        sqlx::query_scalar("SELECT count(*) FROM model_effects WHERE consumer = $1 AND variant <> 0")
            .bind(&consumer)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    prop_assert_eq!(variants, 0, "a conflicting payload never ran the handler");
    let dead: BTreeMap<(String, String), i64> = sqlx::query_as(
        "SELECT message_id, reason, count(*) FROM txinbox.dead_letters WHERE consumer = $1 GROUP BY 1, 2",
    )
    .bind(&consumer)
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, reason, n): (String, String, i64)| ((id, reason), n))
    .collect();
    prop_assert_eq!(
        &dead,
        &want_dead,
        "dead letters: one per message that cannot succeed, one per conflict"
    );

    // The broker: every delivery of a dead-lettered message went to the dead letters, no
    // delivery of a message that succeeded did (conflicting copies aside).
    let broker_dead: Vec<(String, String)> = broker
        .dead_letters()
        .into_iter()
        .map(|(m, d)| (m.native_id().unwrap().to_owned(), d.reason.as_str().to_owned()))
        .collect();
    for (id, reason) in &broker_dead {
        let expected = want_dead.contains_key(&(id.clone(), reason.clone()));
        prop_assert!(
            expected,
            "unexpected dead letter on the broker: {} {}",
            id,
            reason
        );
    }
    for (id, reason) in want_dead.keys() {
        prop_assert!(
            broker_dead.iter().any(|(i, r)| i == id && r == reason),
            "{} ({}) never reached the broker's dead letters",
            id,
            reason
        );
    }
    // No delivery of a message that cannot succeed was acknowledged, and every delivery was
    // settled.
    let cannot_succeed: Vec<String> = s
        .kinds
        .iter()
        .enumerate()
        .filter(|(_, k)| k.dead_letter_reason().is_some())
        .map(|(e, _)| format!("e{e}"))
        .collect();
    for ack in broker.acks() {
        let id = ack.native_id.unwrap_or_default();
        prop_assert!(!cannot_succeed.contains(&id), "{} was acknowledged", id);
    }
    prop_assert_eq!(broker.pending(), 0, "every delivery is settled");
    Ok(())
}

#[test]
fn batches_do_what_one_message_at_a_time_would() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let db = runtime.block_on(async {
        let db = TestDb::new(10).await;
        sqlx::query("CREATE TABLE model_effects (consumer text NOT NULL, message_id text NOT NULL, variant int NOT NULL)")
            .execute(&db.pool)
            .await
            .unwrap();
        db
    });
    let cases: u32 = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    let case = std::sync::atomic::AtomicUsize::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let result = runner.run(&scenario(), |s| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        runtime.block_on(check(&db, n, &s))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
