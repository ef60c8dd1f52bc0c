//! The [`InboxStore`] suite: the contract every inbox store must keep, whatever the database.
//!
//! Five functions, each taking a freshly migrated store (one database for all five is fine:
//! each uses its own consumer names):
//!
//! | function | the contract it checks | the runner provides |
//! |---|---|---|
//! | [`contract`] | claims, duplicates, conflicts, failures that never burn the key, dead letters (idempotent), positions, concurrent claims of one key | `dead_letters(reason)`: how many dead letters the store holds with that reason |
//! | [`batches`] | `claim_batch` / `confirm_batch` decide like `claim`, in one transaction; `confirm_and_save_positions` writes positions only when confirmed | — |
//! | [`duplicates`] | `record_duplicates` counts per entry, only when committed | `duplicates(id)`: the stored duplicate count of consumer `"dups"`'s row `id` |
//! | [`subscriptions`] | one consumer group per consumer name and topic | — |
//! | [`retention`] | the consumer's retention deletes old terminal rows, keeps recent, `retrying` and not-yet-read ones (stores whose `retention_pool` is `Some`) | — |
//!
//! ```no_run
//! use std::sync::Arc;
//! use txinbox::sqlx;
//! use txinbox_testing::conformance::store;
//!
//! # async fn run(pool: sqlx::PgPool) {
//! let inbox = Arc::new(txinbox::PostgresInbox::new(pool.clone()));
//! let counts = pool.clone();
//! store::contract(inbox.clone(), move |reason| {
//!     let pool = counts.clone();
//!     async move {
//!         sqlx::query_scalar("SELECT count(*) FROM txinbox.dead_letters WHERE reason = $1")
//!             .bind(reason)
//!             .fetch_one(&pool)
//!             .await
//!             .unwrap()
//!     }
//! })
//! .await;
//! store::batches(inbox.clone()).await;
//! store::subscriptions(inbox).await;
//! # }
//! ```

use std::sync::Arc;
use std::time::Duration;

use txinbox::sqlx;
use txinbox::{
    dead_letter::DeadLetterReason, message::Headers, message::Origin, position::Position, store::Claim,
    store::DeadLetterOutcome, store::DeadLetterRecord, store::Entry, store::InboxStatus, IdStrategy,
    InboxStore, Message,
};

/// A message at a source position of its own: the same ID and payload give the same offset
/// (a redelivery of one record), anything else another (another record).
fn message(id: &str, payload: &'static str) -> Message {
    let offset = i64::from_le_bytes(
        txinbox::message::Fingerprint::PayloadBytes.of(&Message::new(
            format!("{id}\0{payload}"),
            Origin::new("memory", "orders"),
        ))[..8]
            .try_into()
            .unwrap(),
    )
    .rem_euclid(1 << 40);
    Message::new(payload, Origin::new("memory", "orders").at(0, offset))
        .with_native_id(id)
        .with_headers(Headers::new().with("k", "v"))
}

struct Keyed {
    msg: Message,
    id: txinbox::MessageId,
    fp: [u8; 32],
}

impl Keyed {
    fn new(id: &str, payload: &'static str) -> Keyed {
        let msg = message(id, payload);
        let id = IdStrategy::Native.derive(&msg).unwrap();
        let fp = txinbox::message::Fingerprint::PayloadBytes.of(&msg);
        Keyed { msg, id, fp }
    }
    fn entry<'a>(&'a self, consumer: &'a str) -> Entry<'a> {
        Entry {
            consumer,
            id: &self.id,
            fingerprint: &self.fp,
            origin: self.msg.origin(),
        }
    }
}

/// Claims `k` in a fresh transaction and commits or rolls back.
async fn claim<S: InboxStore>(store: &S, e: &Entry<'_>, commit: bool) -> Claim {
    let mut tx = store.begin().await.unwrap();
    let c = store.claim(&mut *tx, e).await.unwrap();
    if commit {
        store.commit(tx).await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    c
}

/// The single-message contract: claims, duplicates, conflicts, failures that never burn the
/// key, dead letters and their idempotence, positions, and two concurrent claims of one key.
/// `dead_letters(reason)` counts the store's stored dead letters with that reason.
pub async fn contract<S, F, Fut>(store: Arc<S>, dead_letters: F)
where
    S: InboxStore,
    F: Fn(&'static str) -> Fut,
    Fut: std::future::Future<Output = i64>,
{
    let c = "conformance";
    let a = Keyed::new("a", "payload-a");
    let a_other = Keyed::new("a", "payload-a2");

    // New key: claimed at attempt 1; a rolled-back claim leaves nothing behind.
    assert_eq!(
        claim(&*store, &a.entry(c), false).await,
        Claim::New { attempt: 1 }
    );
    assert_eq!(claim(&*store, &a.entry(c), true).await, Claim::New { attempt: 1 });
    // Committed: a duplicate with the same fingerprint, a conflict with another.
    assert_eq!(
        claim(&*store, &a.entry(c), false).await,
        Claim::Duplicate(InboxStatus::Processed)
    );
    assert_eq!(claim(&*store, &a_other.entry(c), false).await, Claim::Conflict);
    // Another consumer is another key space.
    assert_eq!(
        claim(&*store, &a.entry("other"), false).await,
        Claim::New { attempt: 1 }
    );

    // Failures are counted apart and never burn the key.
    let b = Keyed::new("b", "payload-b");
    assert_eq!(
        store.record_failure(&b.entry(c), "boom 1").await.unwrap(),
        Some(1)
    );
    assert_eq!(
        store.record_failure(&b.entry(c), "boom 2").await.unwrap(),
        Some(2)
    );
    assert_eq!(
        claim(&*store, &b.entry(c), false).await,
        Claim::New { attempt: 3 }
    );
    let b_other = Keyed::new("b", "payload-b2");
    assert_eq!(
        claim(&*store, &b_other.entry(c), false).await,
        Claim::Conflict,
        "retrying row, other payload"
    );
    assert_eq!(claim(&*store, &b.entry(c), true).await, Claim::New { attempt: 3 });
    assert_eq!(
        store.record_failure(&b.entry(c), "late").await.unwrap(),
        None,
        "a terminal key is not counted again"
    );

    // Dead letters: the key becomes terminal, a redelivery is a duplicate.
    let d = Keyed::new("d", "payload-d");
    fn record(k: &Keyed, reason: DeadLetterReason) -> DeadLetterRecord<'_> {
        DeadLetterRecord {
            consumer: "conformance",
            entry: Some(k.entry("conformance")),
            message: &k.msg,
            reason,
            error: "bad",
            attempts: 1,
            payload_limit: 1 << 20,
        }
    }
    assert_eq!(
        store
            .dead_letter(&record(&d, DeadLetterReason::Permanent))
            .await
            .unwrap(),
        DeadLetterOutcome::Recorded
    );
    assert_eq!(
        claim(&*store, &d.entry(c), false).await,
        Claim::Duplicate(InboxStatus::DeadLettered)
    );
    // Dead-lettering a key another consumer instance already processed records nothing.
    assert_eq!(
        store
            .dead_letter(&record(&a, DeadLetterReason::Permanent))
            .await
            .unwrap(),
        DeadLetterOutcome::AlreadyProcessed
    );
    // A conflict is recorded without touching the processed row.
    assert_eq!(
        store
            .dead_letter(&record(&a_other, DeadLetterReason::Conflict))
            .await
            .unwrap(),
        DeadLetterOutcome::Recorded
    );
    assert_eq!(
        claim(&*store, &a.entry(c), false).await,
        Claim::Duplicate(InboxStatus::Processed)
    );
    // Dead-lettering the same message again (a retry after an unknown COMMIT outcome) records
    // nothing new, but the broker must still be told.
    assert_eq!(
        store
            .dead_letter(&record(&d, DeadLetterReason::Permanent))
            .await
            .unwrap(),
        DeadLetterOutcome::AlreadyDeadLettered
    );
    // A failed message whose ID another payload took meanwhile is recorded as a conflict, never
    // acked as a duplicate.
    let g = Keyed::new("g", "payload-g");
    let g_other = Keyed::new("g", "payload-g2");
    assert_eq!(
        claim(&*store, &g_other.entry(c), true).await,
        Claim::New { attempt: 1 }
    );
    assert_eq!(
        store
            .dead_letter(&record(&g, DeadLetterReason::Permanent))
            .await
            .unwrap(),
        DeadLetterOutcome::RecordedAsConflict
    );

    // A message without a usable ID has no entry.
    let no_id = message("", "x");
    let missing = DeadLetterRecord {
        consumer: c,
        entry: None,
        message: &no_id,
        reason: DeadLetterReason::MissingId,
        error: "no id",
        attempts: 0,
        payload_limit: 1 << 20,
    };
    assert_eq!(
        store.dead_letter(&missing).await.unwrap(),
        DeadLetterOutcome::Recorded
    );
    // Dead letters are idempotent: the same record read again (a restart, a replay) at the
    // same source position, and the same conflict again, record nothing new.
    assert_eq!(
        store.dead_letter(&missing).await.unwrap(),
        DeadLetterOutcome::AlreadyDeadLettered,
        "a message without an ID, read again at its position"
    );
    assert_eq!(
        store
            .dead_letter(&record(&a_other, DeadLetterReason::Conflict))
            .await
            .unwrap(),
        DeadLetterOutcome::AlreadyDeadLettered,
        "the same conflict again"
    );
    let elsewhere = message("", "x");
    let elsewhere = Message::new(
        elsewhere.payload().clone(),
        Origin::new("memory", "orders").at(1, 7),
    );
    let another = DeadLetterRecord {
        message: &elsewhere,
        ..missing
    };
    assert_eq!(
        store.dead_letter(&another).await.unwrap(),
        DeadLetterOutcome::Recorded,
        "the same payload at another position is another record"
    );
    assert_eq!(dead_letters("permanent_error").await, 1);
    assert_eq!(dead_letters("conflict").await, 2);
    assert_eq!(dead_letters("missing_id").await, 2);

    // The latest dead letter of a message can be read back (to resend it to the broker).
    assert_eq!(
        store.dead_letter_of(c, "d").await.unwrap(),
        Some(("permanent_error".to_string(), "bad".to_string()))
    );
    assert_eq!(store.dead_letter_of(c, "nope").await.unwrap(), None);

    // Positions: dead letters never move them; saved in the caller's transaction, overwritten,
    // read back per lane.
    assert!(store.load_positions(c, "orders").await.unwrap().is_empty());
    let mut tx = store.begin().await.unwrap();
    let p1 = Position {
        source: "orders".into(),
        lane: "1".into(),
        next: 10,
    };
    store.save_position(&mut *tx, c, &p1).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(
        store.load_positions(c, "orders").await.unwrap().is_empty(),
        "rolled back with the transaction"
    );
    let mut tx = store.begin().await.unwrap();
    store.save_position(&mut *tx, c, &p1).await.unwrap();
    store
        .save_position(
            &mut *tx,
            c,
            &Position {
                next: 11,
                ..p1.clone()
            },
        )
        .await
        .unwrap();
    store.commit(tx).await.unwrap();
    assert_eq!(
        store.load_positions(c, "orders").await.unwrap(),
        [("1".to_string(), 11)]
    );
    // What a source stores itself when it gives a lane up or the lane is quiet
    // (`PositionStore::advance`, Kafka under key ordering): in a transaction of its own,
    // forward only (a late prefix must not take the position back).
    let advance = |next| {
        let p = Position { next, ..p1.clone() };
        let store = store.clone();
        async move {
            txinbox::position::PositionStore::advance(&*store, c, &p)
                .await
                .unwrap()
        }
    };
    advance(9).await;
    assert_eq!(
        store.load_positions(c, "orders").await.unwrap(),
        [("1".to_string(), 11)],
        "advance never moves a position back"
    );
    advance(15).await;
    assert_eq!(
        store.load_positions(c, "orders").await.unwrap(),
        [("1".to_string(), 15)]
    );

    // Two concurrent claims of one key: the second waits for the first, then sees a duplicate.
    let e = Arc::new(Keyed::new("e", "payload-e"));
    let mut first = store.begin().await.unwrap();
    assert_eq!(
        store.claim(&mut *first, &e.entry(c)).await.unwrap(),
        Claim::New { attempt: 1 }
    );
    let second = {
        let (store, e) = (store.clone(), e.clone());
        tokio::spawn(async move { claim(&*store, &e.entry("conformance"), true).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "the second claim must wait for the first transaction"
    );
    store.commit(first).await.unwrap();
    assert_eq!(second.await.unwrap(), Claim::Duplicate(InboxStatus::Processed));

    // ...and if the first rolls back, the second claims the key.
    let f = Arc::new(Keyed::new("f", "payload-f"));
    let mut first = store.begin().await.unwrap();
    assert_eq!(
        store.claim(&mut *first, &f.entry(c)).await.unwrap(),
        Claim::New { attempt: 1 }
    );
    let second = {
        let (store, f) = (store.clone(), f.clone());
        tokio::spawn(async move { claim(&*store, &f.entry("conformance"), true).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.rollback().await.unwrap();
    assert_eq!(second.await.unwrap(), Claim::New { attempt: 1 });
}

/// Duplicate counting: `record_duplicates` adds one per entry, repeats included, only when
/// its transaction commits. `duplicates(id)` reads the `duplicates` column of consumer
/// `"dups"`'s row for `id`.
pub async fn duplicates<S, F, Fut>(store: Arc<S>, duplicates: F)
where
    S: InboxStore,
    F: Fn(&'static str) -> Fut,
    Fut: std::future::Future<Output = i64>,
{
    let c = "dups";
    let (x, y) = (Keyed::new("x", "p-x"), Keyed::new("y", "p-y"));
    for k in [&x, &y] {
        assert_eq!(claim(&*store, &k.entry(c), true).await, Claim::New { attempt: 1 });
    }
    let entries = [x.entry(c), x.entry(c), y.entry(c)];
    let mut tx = store.begin().await.unwrap();
    store.record_duplicates(&mut *tx, &entries).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(
        (duplicates("x").await, duplicates("y").await),
        (0, 0),
        "rolled back"
    );
    let mut tx = store.begin().await.unwrap();
    store.record_duplicates(&mut *tx, &entries).await.unwrap();
    store.record_duplicates(&mut *tx, &[]).await.unwrap();
    store.commit(tx).await.unwrap();
    assert_eq!(
        (duplicates("x").await, duplicates("y").await),
        (2, 1),
        "one per entry"
    );
}

/// The batch claim contract: `claim_batch` decides every entry as `claim` would, in order, in
/// one transaction, including repeats of one key inside the batch; `confirm_batch` sees
/// whether the transaction still holds the batch's rows.
pub async fn batches<S>(store: Arc<S>)
where
    S: InboxStore,
    for<'c> &'c mut <S::Db as sqlx::Database>::Connection: sqlx::Executor<'c, Database = S::Db>,
{
    let c = "batch";
    // State before the batch: "done" processed, "dead" dead-lettered, "retry" failed once.
    let done = Keyed::new("done", "p-done");
    assert_eq!(
        claim(&*store, &done.entry(c), true).await,
        Claim::New { attempt: 1 }
    );
    let dead = Keyed::new("dead", "p-dead");
    let record = DeadLetterRecord {
        consumer: c,
        entry: Some(dead.entry(c)),
        message: &dead.msg,
        reason: DeadLetterReason::Permanent,
        error: "bad",
        attempts: 1,
        payload_limit: 1 << 20,
    };
    assert_eq!(
        store.dead_letter(&record).await.unwrap(),
        DeadLetterOutcome::Recorded
    );
    let retry = Keyed::new("retry", "p-retry");
    assert_eq!(
        store.record_failure(&retry.entry(c), "once").await.unwrap(),
        Some(1)
    );

    let x = Keyed::new("x", "p-x");
    let y = Keyed::new("y", "p-y");
    let y_other = Keyed::new("y", "p-y2");
    let done_other = Keyed::new("done", "p-done2");
    let batch = [
        &x,          // new
        &done,       // duplicate of a committed row
        &x,          // the same ID again, same payload: a duplicate of the first occurrence
        &y,          // new
        &y_other,    // the same ID again, other payload: a conflict with the first occurrence
        &dead,       // a redelivered dead letter
        &retry,      // a retrying row: claimed, attempt 2
        &done_other, // conflict with a committed row
        &x,          // a third occurrence
    ];
    let entries: Vec<Entry<'_>> = batch.iter().map(|k| k.entry(c)).collect();
    let expected = vec![
        Claim::New { attempt: 1 },
        Claim::Duplicate(InboxStatus::Processed),
        Claim::Duplicate(InboxStatus::Processed),
        Claim::New { attempt: 1 },
        Claim::Conflict,
        Claim::Duplicate(InboxStatus::DeadLettered),
        Claim::New { attempt: 2 },
        Claim::Conflict,
        Claim::Duplicate(InboxStatus::Processed),
    ];

    // Rolled back: nothing stays, and the same batch decides the same way again.
    let mut tx = store.begin().await.unwrap();
    assert_eq!(store.claim_batch(&mut *tx, &entries).await.unwrap(), expected);
    tx.rollback().await.unwrap();
    assert_eq!(
        claim(&*store, &x.entry(c), false).await,
        Claim::New { attempt: 1 }
    );

    let mut tx = store.begin().await.unwrap();
    assert_eq!(store.claim_batch(&mut *tx, &entries).await.unwrap(), expected);
    let claimed = [x.entry(c), y.entry(c), retry.entry(c)];
    assert!(store.confirm_batch(&mut *tx, &claimed).await.unwrap());
    let not_claimed = Keyed::new("never", "p-never");
    assert!(
        !store
            .confirm_batch(&mut *tx, &[not_claimed.entry(c)])
            .await
            .unwrap(),
        "a key the transaction does not hold is not confirmed"
    );
    store.commit(tx).await.unwrap();
    for k in [&x, &y, &retry] {
        assert_eq!(
            claim(&*store, &k.entry(c), false).await,
            Claim::Duplicate(InboxStatus::Processed)
        );
    }
    assert_eq!(claim(&*store, &y_other.entry(c), false).await, Claim::Conflict);

    // Two concurrent batches sharing a key: the second waits for the first, then sees it.
    let p = Arc::new(Keyed::new("p", "p-p"));
    let q = Arc::new(Keyed::new("q", "p-q"));
    let mut first = store.begin().await.unwrap();
    assert_eq!(
        store
            .claim_batch(&mut *first, &[p.entry(c), q.entry(c)])
            .await
            .unwrap(),
        [Claim::New { attempt: 1 }, Claim::New { attempt: 1 }]
    );
    let second = {
        let (store, p, q) = (store.clone(), p.clone(), q.clone());
        tokio::spawn(async move {
            let r = Keyed::new("r", "p-r");
            let mut tx = store.begin().await.unwrap();
            let claims = store
                .claim_batch(&mut *tx, &[r.entry("batch"), q.entry("batch"), p.entry("batch")])
                .await
                .unwrap();
            store.commit(tx).await.unwrap();
            claims
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!second.is_finished(), "the second batch must wait for the first");
    store.commit(first).await.unwrap();
    assert_eq!(
        second.await.unwrap(),
        [
            Claim::New { attempt: 1 },
            Claim::Duplicate(InboxStatus::Processed),
            Claim::Duplicate(InboxStatus::Processed)
        ]
    );

    // A handler that ends the transaction itself takes the batch's claim with it.
    let (u, v) = (Keyed::new("u", "p-u"), Keyed::new("v", "p-v"));
    let mut tx = store.begin().await.unwrap();
    let batch = [u.entry(c), v.entry(c)];
    store.claim_batch(&mut *tx, &batch).await.unwrap();
    sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await.unwrap();
    assert!(
        !store.confirm_batch(&mut *tx, &batch).await.unwrap(),
        "a batch whose transaction was rolled back under it is not confirmed"
    );
    // Back inside a transaction, so that the connection returns to the pool as it left it (a
    // store may have opened one already: SQLite's does, and refuses a second BEGIN).
    let _ = sqlx::raw_sql("BEGIN").execute(&mut *tx).await;
    tx.rollback().await.unwrap();
    assert_eq!(
        claim(&*store, &u.entry(c), false).await,
        Claim::New { attempt: 1 }
    );

    // The same, while another worker commits a redelivery of the batch's first key: its row
    // now exists, committed, but not by this transaction, which is gone. The check must see
    // the transaction, not the row, or the rest of the batch is acked without its effects.
    let (w1, w2, w3) = (
        Keyed::new("w1", "p-w1"),
        Keyed::new("w2", "p-w2"),
        Keyed::new("w3", "p-w3"),
    );
    let elsewhere = [Position {
        source: "redelivered".into(),
        lane: "0".into(),
        next: 7,
    }];
    let batch = [w1.entry(c), w2.entry(c)];
    let mut tx = store.begin().await.unwrap();
    assert_eq!(
        store.claim_batch(&mut *tx, &batch).await.unwrap(),
        [Claim::New { attempt: 1 }, Claim::New { attempt: 1 }]
    );
    sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await.unwrap();
    assert_eq!(
        claim(&*store, &w1.entry(c), true).await,
        Claim::New { attempt: 1 }
    );
    assert!(
        !store.confirm_batch(&mut *tx, &batch).await.unwrap(),
        "a batch whose transaction ended is not confirmed, though its first key was committed since by another"
    );
    assert!(
        !store
            .confirm_and_save_positions(&mut *tx, &batch, c, &elsewhere)
            .await
            .unwrap(),
        "nor with positions"
    );
    let _ = sqlx::raw_sql("BEGIN").execute(&mut *tx).await;
    tx.rollback().await.unwrap();
    assert!(
        store.load_positions(c, "redelivered").await.unwrap().is_empty(),
        "no position written, not even outside the transaction"
    );
    assert_eq!(
        claim(&*store, &w2.entry(c), false).await,
        Claim::New { attempt: 1 },
        "the rest of the batch was not committed"
    );
    // One message: the same check, with and without positions.
    let mut tx = store.begin().await.unwrap();
    assert_eq!(
        store.claim(&mut *tx, &w3.entry(c)).await.unwrap(),
        Claim::New { attempt: 1 }
    );
    sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await.unwrap();
    assert_eq!(
        claim(&*store, &w3.entry(c), true).await,
        Claim::New { attempt: 1 }
    );
    assert!(!store.confirm(&mut *tx, &w3.entry(c)).await.unwrap());
    assert!(!store
        .confirm_and_save_positions(&mut *tx, &[w3.entry(c)], c, &elsewhere)
        .await
        .unwrap());
    let _ = sqlx::raw_sql("BEGIN").execute(&mut *tx).await;
    tx.rollback().await.unwrap();
    assert!(store.load_positions(c, "redelivered").await.unwrap().is_empty());
    // A handler that ended the transaction and began another: not the transaction that
    // claimed either.
    let w4 = Keyed::new("w4", "p-w4");
    let mut tx = store.begin().await.unwrap();
    store.claim(&mut *tx, &w4.entry(c)).await.unwrap();
    sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await.unwrap();
    assert_eq!(
        claim(&*store, &w4.entry(c), true).await,
        Claim::New { attempt: 1 }
    );
    sqlx::raw_sql("BEGIN").execute(&mut *tx).await.unwrap();
    assert!(
        !store.confirm(&mut *tx, &w4.entry(c)).await.unwrap(),
        "a transaction the handler began is not the one that claimed"
    );
    tx.rollback().await.unwrap();

    // The last step before COMMIT (`confirm_and_save_positions`): a transaction ended under it
    // is not confirmed and writes no position, not even outside the transaction (on the
    // connection it would commit on its own, past messages whose effects were rolled back).
    let positions = |next: i64| {
        ["0", "1"].map(|lane| Position {
            source: "confirmed".into(),
            lane: lane.into(),
            next: next + i64::from(lane == "1"),
        })
    };
    let stored = || async {
        let mut p = store.load_positions(c, "confirmed").await.unwrap();
        p.sort();
        p
    };
    let (s1, s2) = (Keyed::new("s1", "p-s1"), Keyed::new("s2", "p-s2"));
    let batch = [s1.entry(c), s2.entry(c)];
    let mut tx = store.begin().await.unwrap();
    store.claim_batch(&mut *tx, &batch).await.unwrap();
    sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await.unwrap();
    assert!(
        !store
            .confirm_and_save_positions(&mut *tx, &batch, c, &positions(5))
            .await
            .unwrap(),
        "a transaction rolled back under it is not confirmed"
    );
    // Back inside a transaction, so that the connection returns to the pool as it left it.
    let _ = sqlx::raw_sql("BEGIN").execute(&mut *tx).await;
    tx.rollback().await.unwrap();
    assert!(
        stored().await.is_empty(),
        "an unconfirmed transaction's positions are not written"
    );
    // Confirmed: every lane's position is written, with the transaction (rolled back first,
    // then committed).
    for commit in [false, true] {
        let mut tx = store.begin().await.unwrap();
        store.claim_batch(&mut *tx, &batch).await.unwrap();
        assert!(store
            .confirm_and_save_positions(&mut *tx, &batch, c, &positions(5))
            .await
            .unwrap());
        if commit {
            store.commit(tx).await.unwrap();
        } else {
            tx.rollback().await.unwrap();
            assert!(stored().await.is_empty(), "rolled back with the transaction");
        }
    }
    assert_eq!(stored().await, [("0".to_string(), 5), ("1".to_string(), 6)]);
    // Nothing claimed (a batch of duplicates): the positions are written as `save_position`
    // writes them, overwriting; with no position it only confirms.
    let mut tx = store.begin().await.unwrap();
    assert!(store
        .confirm_and_save_positions(&mut *tx, &[], c, &positions(3))
        .await
        .unwrap());
    store.commit(tx).await.unwrap();
    assert_eq!(stored().await, [("0".to_string(), 3), ("1".to_string(), 4)]);
    let mut tx = store.begin().await.unwrap();
    let lone = Keyed::new("s3", "p-s3");
    store.claim_batch(&mut *tx, &[lone.entry(c)]).await.unwrap();
    assert!(store
        .confirm_and_save_positions(&mut *tx, &[lone.entry(c)], c, &[])
        .await
        .unwrap());
    assert!(!store
        .confirm_and_save_positions(&mut *tx, &[not_claimed.entry(c)], c, &[])
        .await
        .unwrap());
    // A live transaction that does not hold the key: not confirmed, and with positions given
    // none is written, even once the transaction commits.
    assert!(!store
        .confirm_and_save_positions(&mut *tx, &[not_claimed.entry(c)], c, &positions(9))
        .await
        .unwrap());
    store.commit(tx).await.unwrap();
    assert_eq!(
        stored().await,
        [("0".to_string(), 3), ("1".to_string(), 4)],
        "a key the transaction does not hold writes no position"
    );

    // An empty batch claims nothing.
    let mut tx = store.begin().await.unwrap();
    assert!(store.claim_batch(&mut *tx, &[]).await.unwrap().is_empty());
    assert!(store.confirm_batch(&mut *tx, &[]).await.unwrap());
    tx.rollback().await.unwrap();
}

/// One subscription per consumer name and source: the first is recorded, seeing it again is
/// fine, another one is reported and not recorded.
pub async fn subscriptions<S: InboxStore>(store: Arc<S>) {
    let record = |consumer: &'static str, topic: &'static str, group: &'static str| {
        let store = store.clone();
        async move {
            store
                .record_subscription(consumer, "kafka", topic, group)
                .await
                .unwrap()
        }
    };
    assert_eq!(record("svc", "orders", "svc-group").await, None);
    assert_eq!(
        record("svc", "orders", "svc-group").await,
        None,
        "the same group again"
    );
    assert_eq!(
        record("svc", "orders", "other-group").await.as_deref(),
        Some("svc-group"),
        "a second group under one consumer name is reported"
    );
    assert_eq!(
        record("svc", "orders", "other-group").await.as_deref(),
        Some("svc-group"),
        "and was not recorded"
    );
    assert_eq!(
        record("svc", "refunds", "other-group").await,
        None,
        "another topic"
    );
    assert_eq!(
        record("other", "orders", "other-group").await,
        None,
        "another consumer"
    );
}

/// The delete path of the consumer's retention ([`InboxStore::retention_pool`], the janitor's
/// [`InboxSweep`](txinbox::ops::retention::InboxSweep), the statements of `txinbox purge`):
/// terminal rows (processed, dead-lettered) older than the window are deleted, in batches;
/// recent rows, `retrying` rows and rows at or after the stored position of their lane are
/// kept; a deleted ID is new again, a kept one still a duplicate; the horizon is recorded.
/// For stores that support retention: panics when `retention_pool` is `None`.
pub async fn retention<S>(store: Arc<S>)
where
    S: InboxStore,
    for<'c> &'c mut <S::Db as sqlx::Database>::Connection: sqlx::Executor<'c, Database = S::Db>,
{
    use txinbox::janitor::{Janitor, Schedule};
    use txinbox::ops::retention::{horizon, InboxSweep};

    let c = "retention";
    let pool = store
        .retention_pool()
        .expect("retention_pool: the store supports the consumer's retention");
    // Partition 1 of "orders", offsets chosen: the stored position is 10.
    let at = |id: &str, offset: i64| {
        let msg =
            Message::new(format!("p-{id}"), Origin::new("memory", "orders").at(1, offset)).with_native_id(id);
        let id = IdStrategy::Native.derive(&msg).unwrap();
        let fp = txinbox::message::Fingerprint::PayloadBytes.of(&msg);
        Keyed { msg, id, fp }
    };
    let (old1, old2, old3, dead) = (at("old-1", 1), at("old-2", 2), at("old-3", 3), at("old-dead", 4));
    let (retrying, pinned, fresh) = (at("retrying", 5), at("pinned", 10), at("fresh", 11));
    for k in [&old1, &old2, &old3, &pinned] {
        assert_eq!(claim(&*store, &k.entry(c), true).await, Claim::New { attempt: 1 });
    }
    let record = DeadLetterRecord {
        consumer: c,
        entry: Some(dead.entry(c)),
        message: &dead.msg,
        reason: DeadLetterReason::Permanent,
        error: "bad",
        attempts: 1,
        payload_limit: 1 << 20,
    };
    assert_eq!(
        store.dead_letter(&record).await.unwrap(),
        DeadLetterOutcome::Recorded
    );
    assert_eq!(
        store.record_failure(&retrying.entry(c), "once").await.unwrap(),
        Some(1)
    );
    let mut tx = store.begin().await.unwrap();
    let position = Position {
        source: "orders".into(),
        lane: "1".into(),
        next: 10,
    };
    store.save_position(&mut *tx, c, &position).await.unwrap();
    store.commit(tx).await.unwrap();
    // Everything above is older than the window; `fresh` is not.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        claim(&*store, &fresh.entry(c), true).await,
        Claim::New { attempt: 1 }
    );

    let schedule = Schedule {
        batch: 2,
        pause: Duration::ZERO,
        ..Schedule::default()
    };
    let sweep = InboxSweep::forced(pool.clone(), c, Duration::from_millis(400));
    assert!(
        InboxSweep::new(pool.clone(), c, Duration::from_millis(400)).is_err(),
        "a window inside the dedup window is refused unless forced"
    );
    let janitor = Janitor::new(sweep, schedule, "inbox", Some(("consumer", c))).unwrap();
    assert_eq!(
        janitor.pass().await.unwrap(),
        4,
        "the processed and dead-lettered rows before the position, in batches of 2"
    );
    assert_eq!(janitor.pass().await.unwrap(), 0, "nothing left to delete");
    assert!(
        horizon(pool.db(), c).await.unwrap().is_some(),
        "the horizon is recorded"
    );

    // A deleted ID is new again; kept ones are what they were.
    for k in [&old1, &dead] {
        assert_eq!(
            claim(&*store, &k.entry(c), false).await,
            Claim::New { attempt: 1 }
        );
    }
    assert_eq!(
        claim(&*store, &pinned.entry(c), false).await,
        Claim::Duplicate(InboxStatus::Processed),
        "at the stored position: a restart reads it again"
    );
    assert_eq!(
        claim(&*store, &fresh.entry(c), false).await,
        Claim::Duplicate(InboxStatus::Processed),
        "inside the window"
    );
    assert_eq!(
        claim(&*store, &retrying.entry(c), false).await,
        Claim::New { attempt: 2 },
        "a retrying row is never deleted: its attempt count goes on"
    );
}
