//! Source positions are stored with the effects, and move past a dead letter only once the
//! broker has its copy; a dead letter read again is not recorded again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use txinbox::{
    message::Origin, position::Position, source::Capabilities, source::Lane, source::RetryMode,
    source::SettleError, source::Settlement, source::SourceError, Consumer, Delivery, IdStrategy, InboxStore,
    Message, MessageSource,
};

use super::support::{DepositHandler, TestDb};

/// A Kafka-like source: one lane per partition, positions `offset + 1`. Records how each
/// delivery was settled; the first `refuse_dead_letters` dead-letter settlements fail (a
/// dead-letter topic that does not take the copy).
struct Positioned {
    records: std::vec::IntoIter<(i32, i64, &'static str)>,
    /// The assignment each record comes from: a new one starts with each offset lower than
    /// its predecessor's, or with each listed index (`reassigned_at`).
    reassigned_at: Vec<usize>,
    received: usize,
    assignment: u64,
    settled: Settlements,
    refuse_dead_letters: Arc<AtomicUsize>,
}

/// `(partition, offset, "ack" | "dead_letter")` per settlement that reached the "broker".
type Settlements = Arc<Mutex<Vec<(i32, i64, &'static str)>>>;

impl Positioned {
    fn new(records: Vec<(i32, i64, &'static str)>) -> Self {
        Positioned {
            records: records.into_iter(),
            settled: Settlements::default(),
            refuse_dead_letters: Arc::default(),
            reassigned_at: Vec::new(),
            received: 0,
            assignment: 1,
        }
    }

    /// The records from index `i` on come from a new assignment of their lane.
    fn reassigned_at(mut self, i: usize) -> Self {
        self.reassigned_at.push(i);
        self
    }

    /// The first `n` dead-letter settlements fail.
    fn refusing_dead_letters(self, n: usize) -> Self {
        self.refuse_dead_letters.store(n, Ordering::SeqCst);
        self
    }
}

struct PositionedDelivery {
    message: Message,
    assignment: u64,
    settled: Settlements,
    refuse_dead_letters: Arc<AtomicUsize>,
}

#[txinbox::async_trait]
impl MessageSource for Positioned {
    type Delivery = PositionedDelivery;
    async fn receive(&mut self) -> Result<Option<PositionedDelivery>, SourceError> {
        if self.reassigned_at.contains(&self.received) {
            self.assignment += 1;
        }
        self.received += 1;
        let assignment = self.assignment;
        Ok(self.records.next().map(|(p, off, payload)| {
            let origin = Origin::new("memory", "orders").at(p, off);
            PositionedDelivery {
                message: Message::new(payload, origin),
                assignment,
                settled: self.settled.clone(),
                refuse_dead_letters: self.refuse_dead_letters.clone(),
            }
        }))
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            system: "memory",
            retry: RetryMode::InPlace,
            default_id_strategy: IdStrategy::Offset,
        }
    }
    async fn close(self) -> Result<(), SourceError> {
        Ok(())
    }
}

#[txinbox::async_trait]
impl Delivery for PositionedDelivery {
    fn message(&self) -> &Message {
        &self.message
    }
    fn lane(&self) -> Lane {
        Lane::Ordered(self.message.origin().partition.unwrap().to_string().into())
    }
    fn assignment(&self) -> Option<u64> {
        Some(self.assignment)
    }
    fn position(&self) -> Option<Position> {
        let o = self.message.origin();
        Some(Position {
            source: o.destination.clone(),
            lane: o.partition.unwrap().to_string().into(),
            next: o.offset.unwrap() + 1,
        })
    }
    fn position_to_store(&self) -> Option<Position> {
        self.position()
    }
    async fn settle(self, settlement: Settlement) -> Result<(), SettleError> {
        let o = self.message.origin();
        let kind = match settlement {
            Settlement::DeadLetter(_)
                if self
                    .refuse_dead_letters
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok() =>
            {
                return Err(SettleError::new("the dead-letter topic refused the copy"))
            }
            Settlement::DeadLetter(_) => "dead_letter",
            _ => "ack",
        };
        self.settled
            .lock()
            .unwrap()
            .push((o.partition.unwrap(), o.offset.unwrap(), kind));
        Ok(())
    }
}

fn ok(idx: i64) -> &'static str {
    Box::leak(format!(r#"{{"account":"a","amount":1,"lane":"0","idx":{idx}}}"#).into_boxed_str())
}

async fn run(db: &TestDb, name: &str, source: Positioned) {
    Consumer::builder(name)
        .source(source)
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .batch_linger(Duration::from_millis(100))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
}

async fn positions(db: &TestDb, name: &str) -> Vec<(String, i64)> {
    let mut got = db.inbox().load_positions(name, "orders").await.unwrap();
    got.sort();
    got
}

#[tokio::test]
async fn positions_are_stored_with_effects_duplicates_and_confirmed_dead_letters() {
    let db = TestDb::new(10).await;
    run(
        &db,
        "positions",
        Positioned::new(vec![
            (0, 0, ok(0)),
            (0, 1, "not json"), // dead-lettered: the position moves once the broker has the copy
            (1, 7, ok(7)),
        ]),
    )
    .await;
    assert_eq!(
        positions(&db, "positions").await,
        [("0".into(), 2), ("1".into(), 8)]
    );
    assert!(db
        .inbox()
        .load_positions("positions", "other")
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn a_batch_cut_by_dead_letters_stores_the_position_after_each_confirmed_one() {
    let db = TestDb::new(10).await;
    // One batch of six: offset 2 is cut out and dead-lettered, so is the last one (5).
    let source = Positioned::new(vec![
        (0, 0, ok(0)),
        (0, 1, ok(1)),
        (0, 2, "not json"),
        (0, 3, ok(3)),
        (0, 4, ok(4)),
        (0, 5, "not json"),
    ]);
    let settled = source.settled.clone();
    run(&db, "batch-positions", source).await;
    assert_eq!(positions(&db, "batch-positions").await, [("0".into(), 6)]);
    assert_eq!(db.scalar("SELECT count(*) FROM effects").await, 4);
    let settled = settled.lock().unwrap().clone();
    assert_eq!(
        settled
            .iter()
            .filter(|s| s.2 == "dead_letter")
            .map(|s| s.1)
            .collect::<Vec<_>>(),
        [2, 5]
    );
}

/// A partition that ends on a run of dead letters: before, its position stayed before the
/// first of them, so every restart read the whole run again and recorded each dead letter once
/// more (for messages without an ID, and conflicts, which the inbox cannot recognise).
#[tokio::test]
async fn a_restart_reads_no_confirmed_dead_letter_again_and_a_reread_records_nothing_new() {
    let db = TestDb::new(10).await;
    let records = vec![
        (0, 0, ok(0)),
        (0, 1, "not json"),
        (0, 2, "not json either"),
        (0, 3, "still not json"),
    ];
    run(&db, "poison-run", Positioned::new(records.clone())).await;
    assert_eq!(
        positions(&db, "poison-run").await,
        [("0".into(), 4)],
        "past the whole run: a restart starts after it"
    );
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 3);

    // The same records read again anyway (a replay, or a crash between the broker's
    // confirmation and the position's commit): the copies go to the broker again, the
    // database records nothing new.
    let again = Positioned::new(records[1..].to_vec());
    let settled = again.settled.clone();
    run(&db, "poison-run", again).await;
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 3);
    assert_eq!(
        settled
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.2 == "dead_letter")
            .count(),
        3,
        "each copy is sent to the broker's dead-letter destination again"
    );

    // Messages without a usable ID (no `ce_id` header here) are recognised by their position.
    for _ in 0..2 {
        Consumer::builder("no-ids")
            .source(Positioned::new(vec![(0, 10, "{}"), (0, 11, "{}")]))
            .inbox(db.inbox())
            .handler(DepositHandler::default())
            .id_strategy(IdStrategy::Header("ce_id".into()))
            .build()
            .unwrap()
            .run()
            .await
            .unwrap();
    }
    assert_eq!(
        db.scalar("SELECT count(*) FROM txinbox.dead_letters WHERE consumer = 'no-ids'")
            .await,
        2,
        "read twice, recorded once each"
    );
}

/// The broker did not take a dead letter's copy: the position must not pass it, whatever the
/// lane processes after it, so a restart reads it again and sends the copy again.
#[tokio::test]
async fn a_dead_letter_the_broker_did_not_take_keeps_the_position_before_it() {
    let db = TestDb::new(10).await;
    let source = Positioned::new(vec![(0, 0, ok(0)), (0, 1, "not json")]).refusing_dead_letters(usize::MAX);
    run(&db, "refused", source).await;
    assert_eq!(positions(&db, "refused").await, [("0".into(), 1)]);
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 1);
}

/// As above, with good records after the refused one on its lane: they must not run (their
/// positions would pass the dead letter's), and must not be acknowledged.
#[tokio::test]
async fn records_after_a_refused_dead_letter_do_not_move_the_position_past_it() {
    let db = TestDb::new(10).await;
    let source = Positioned::new(vec![
        (0, 0, ok(0)),
        (0, 1, "not json"),
        (0, 2, ok(2)),
        (0, 3, ok(3)),
    ])
    .refusing_dead_letters(usize::MAX);
    let settled = source.settled.clone();
    run(&db, "refused-then-good", source).await;
    assert_eq!(positions(&db, "refused-then-good").await, [("0".into(), 1)]);
    assert_eq!(
        *settled.lock().unwrap(),
        [(0, 0, "ack")],
        "nothing after the refused copy is settled"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM effects").await,
        1,
        "nothing after it is applied"
    );
}

/// After a refused dead letter stopped its lane, the source delivers the lane again from the
/// stored position (a Kafka partition assigned again): the lane runs again, the copy is sent
/// again, and everything after it is applied once.
#[tokio::test]
async fn a_lane_stopped_by_a_refused_dead_letter_runs_again_when_redelivered_from_its_position() {
    let db = TestDb::new(10).await;
    let source = Positioned::new(vec![
        (0, 0, ok(0)),
        (0, 1, "not json"),
        (0, 2, ok(2)),
        // Assigned again: from the stored position (1).
        (0, 1, "not json"),
        (0, 2, ok(2)),
        (0, 3, ok(3)),
    ])
    .refusing_dead_letters(1)
    .reassigned_at(3);
    let settled = source.settled.clone();
    run(&db, "stopped-then-again", source).await;
    assert_eq!(positions(&db, "stopped-then-again").await, [("0".into(), 4)]);
    assert_eq!(
        *settled.lock().unwrap(),
        [(0, 0, "ack"), (0, 1, "dead_letter"), (0, 2, "ack"), (0, 3, "ack")]
    );
    assert_eq!(db.scalar("SELECT count(*) FROM effects").await, 3);
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 1);
}

/// Offsets reused (a topic deleted and created again, a mirrored cluster): another record at
/// an offset that already has a pending dead letter is a different dead letter, recorded too.
#[tokio::test]
async fn another_record_at_a_dead_lettered_offset_is_recorded_too() {
    let db = TestDb::new(10).await;
    run(&db, "reused", Positioned::new(vec![(0, 5, "garbage one")])).await;
    run(&db, "reused", Positioned::new(vec![(0, 5, "garbage one")])).await;
    run(
        &db,
        "reused",
        Positioned::new(vec![(0, 5, "a different garbage record")]),
    )
    .await;
    let payloads: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT payload FROM txinbox.dead_letters WHERE consumer = 'reused' ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        payloads,
        [b"garbage one".to_vec(), b"a different garbage record".to_vec()]
    );
}

/// A lane stopped by a refused dead letter, whose partition another member took over and moved
/// on, then assigned back to this consumer at a later position: the new assignment runs (it
/// starts where the database says), it is not dropped for having passed the stop.
#[tokio::test]
async fn a_stopped_lane_assigned_again_at_a_later_position_runs() {
    let db = TestDb::new(10).await;
    let source = Positioned::new(vec![
        (0, 0, ok(0)),
        (0, 1, "not json"),
        (0, 2, ok(2)),
        // Assigned again after another member handled 1..=4.
        (0, 5, ok(5)),
        (0, 6, ok(6)),
    ])
    .refusing_dead_letters(1)
    .reassigned_at(3);
    let settled = source.settled.clone();
    run(&db, "stopped-then-later", source).await;
    assert_eq!(
        *settled.lock().unwrap(),
        [(0, 0, "ack"), (0, 5, "ack"), (0, 6, "ack")]
    );
    assert_eq!(positions(&db, "stopped-then-later").await, [("0".into(), 7)]);
}
