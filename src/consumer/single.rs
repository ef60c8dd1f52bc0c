//! The pipeline for one delivery (DESIGN.md §5):
//!
//! derive ID + fingerprint → BEGIN → claim (insert inbox row) → handler → COMMIT → settle.
//!
//! Invariants kept here:
//! - settle `Ack` only after COMMIT succeeded; a COMMIT error (outcome unknown) goes back
//!   through the claim, never to the broker;
//! - a transient failure rolls back first, then counts the attempt in its own transaction;
//! - a dead letter is recorded in the database before the broker is told;
//! - `begin` and `commit` are never raced against a timer or shutdown (sqlx #4393).

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tracing::{field, Instrument, Span};

use super::{contention_backoff, store_backoff, Shared};
use crate::error::Error;
use crate::handler::{BatchContext, BatchMessage, Context, Handler, HandlerError};
use crate::message::{Fingerprint, MessageId};
use crate::source::{DeadLetter, DeadLetterReason, Delivery, Position, RetryMode, SettleError, Settlement};
use crate::store::{
    clean_text, Claim, DeadLetterOutcome, DeadLetterRecord, Entry, InboxStatus, InboxStore, StoreError,
};

/// How long a settlement may still take once shutdown has begun.
const SETTLE_GRACE: Duration = Duration::from_secs(10);

/// What to tell the broker, decided after the database work is done, with the attempt that
/// decided it (recorded on the span once, at settlement; 0 when no handler ran).
enum Verdict {
    Processed(u32),
    Duplicate,
    /// A redelivery of a message dead-lettered before: sent to the broker's dead-letter
    /// destination again (its copy may never have been confirmed), not recorded again.
    DeadLetterAgain(DeadLetter),
    Retry(Duration, u32),
    DeadLetter(DeadLetter, u32),
}

/// The result of one trip through the message transaction.
enum Attempt {
    Committed(u32),
    Duplicate,
    DeadLetteredBefore,
    Conflict,
    Failed { attempt: u32, error: HandlerError },
}

/// The `txinbox.process` span of one delivery, for its whole life (batched or alone).
/// With feature `otel`, a child of the producer's span when the headers carry its context.
fn span_for<St, H>(shared: &Shared<St, H>, msg: &crate::message::Message) -> Span {
    let origin = msg.origin();
    let span = tracing::info_span!(
        "txinbox.process",
        "messaging.system" = shared.system,
        "messaging.operation.type" = "process",
        "messaging.destination.name" = &*origin.destination,
        "messaging.consumer.group.name" = &*shared.name,
        "messaging.destination.partition.id" = origin.partition,
        "messaging.kafka.offset" = origin.offset,
        "messaging.message.id" = field::Empty,
        "txinbox.attempt" = field::Empty,
        "txinbox.outcome" = field::Empty,
    );
    #[cfg(feature = "otel")]
    crate::otel::adopt_parent(&span, msg.headers());
    span
}

/// Processes one delivery alone, to its settlement, in `span`. `Err` if its lane must not go on
/// without it: it was left unsettled (shutdown or a fatal error came first), or the broker did
/// not take a settlement the database does not record the position of (see [`settle`]).
async fn process_alone<D: Delivery, St: InboxStore, H: Handler<St::Db>>(
    shared: &Shared<St, H>,
    item: Item<D>,
) -> Result<(), Stop> {
    let Item {
        delivery, span, key, ..
    } = item;
    async move {
        let Some(verdict) = decide(shared, &delivery, key).await else {
            tracing::Span::current().record("txinbox.outcome", "abandoned");
            tracing::debug!("left unsettled at shutdown; the broker will redeliver it");
            return Err(Stop::at(&delivery));
        };
        settle(shared, delivery, verdict).await
    }
    .instrument(span)
    .await
}

/// How a lane's task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LaneEnd {
    /// Every delivery it took was settled (or its settlement's failure is harmless).
    Done,
    /// A delivery of an ordered lane was left unsettled, and the ones after it with it: nothing
    /// of the lane may run until the source starts the lane over (see [`Stop`]).
    Stopped(Stop),
}

/// Where an ordered lane stopped: the delivery left unsettled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stop {
    /// Its [`Position::next`], if it has one.
    next: Option<i64>,
    /// Its [`Delivery::assignment`].
    assignment: Option<u64>,
}

impl Stop {
    pub(super) fn at<D: Delivery>(delivery: &D) -> Stop {
        Stop {
            next: delivery.position().map(|p| p.next),
            assignment: delivery.assignment(),
        }
    }

    /// A stop nothing can start over (a failed task: the consumer is stopping).
    pub(super) fn for_good() -> Stop {
        Stop {
            next: None,
            assignment: None,
        }
    }

    /// Whether `delivery` starts the lane over: it comes from another assignment of the lane
    /// (a Kafka partition assigned again starts at the stored position, which never passed
    /// the stopping delivery), or it is at or before the stopping delivery's position.
    pub(super) fn starts_over<D: Delivery>(&self, delivery: &D) -> bool {
        let reassigned = matches!(
            (self.assignment, delivery.assignment()),
            (Some(stopped), Some(now)) if stopped != now
        );
        reassigned || matches!((self.next, delivery.position()), (Some(at), Some(p)) if p.next <= at)
    }
}

/// A delivery of a batch, with what the batch claim needs.
struct Item<D> {
    delivery: D,
    span: Span,
    /// ID and fingerprint; `None` if the message cannot be claimed at all (no usable ID, too
    /// large): the one-message path dead-letters it.
    key: Option<(MessageId, [u8; 32])>,
    /// Must run alone: it caused a batch to be cut, or the batch's culprit is unknown.
    alone: bool,
}

impl<D: Delivery> Item<D> {
    fn new<St, H>(shared: &Shared<St, H>, delivery: D) -> Self {
        let msg = delivery.message();
        let span = span_for(shared, msg);
        // NOTE: the size first, so nothing of an oversized message is parsed or copied.
        let key = if message_size(msg) > shared.max_message_bytes {
            None
        } else {
            shared.id_strategy.derive(msg).ok().map(|id| {
                span.record("messaging.message.id", id.as_str());
                let fingerprint = shared.fingerprint.of(msg);
                (id, fingerprint)
            })
        };
        Item {
            delivery,
            span,
            key,
            alone: false,
        }
    }

    fn batchable(&self) -> bool {
        self.key.is_some() && !self.alone
    }

    fn entry<'a>(&'a self, consumer: &'a str) -> Entry<'a> {
        let (id, fingerprint) = self.key.as_ref().expect("only batchable items are claimed");
        Entry {
            consumer,
            id,
            fingerprint,
            origin: self.delivery.message().origin(),
        }
    }
}

/// How one batch transaction ended.
enum Trip {
    /// Committed: one claim per item, each `New` (processed) or a duplicate.
    Committed(Vec<Claim>),
    /// Rolled back, nothing committed: the item at this index needs the one-message path.
    /// `true` if its handler lost a lock conflict (not the message's fault).
    Cut(usize, bool),
    /// Rolled back (or COMMIT's outcome unknown), culprit unknown: every item runs alone.
    /// `true` if the failure was a lock conflict.
    Unknown(bool),
}

/// Processes deliveries of one lane (in lane order) to their settlements, sharing transactions
/// as micro-batches (see [`ConsumerBuilder::batch_size`](super::ConsumerBuilder::batch_size)).
/// Returns [`LaneEnd::Stopped`] if a delivery of an ordered lane was left unsettled (shutdown, a
/// fatal error, or a settlement the broker refused whose position the database does not hold);
/// the deliveries after it are then dropped unsettled too.
///
/// The failure rule, chosen over savepoints: a savepoint per message costs a round trip each and
/// a PostgreSQL transaction with more than 64 subtransactions overflows the per-backend
/// subtransaction cache, slowing every snapshot on the server. Instead a batch whose message
/// `k` needs the one-message path is rolled back and re-run: messages `..k` as a batch, `k`
/// alone (where its attempt is counted, retried or dead-lettered, and its handler runs once
/// more on a clean transaction, so a failure caused by a neighbour is never blamed on it),
/// then the rest. Failures are rare; the cost is one rolled-back transaction per failure.
pub(super) async fn process_batch<D: Delivery, St: InboxStore, H: Handler<St::Db>>(
    shared: &Shared<St, H>,
    deliveries: Vec<D>,
) -> LaneEnd {
    let mut queue: VecDeque<Item<D>> = deliveries.into_iter().map(|d| Item::new(shared, d)).collect();
    while !queue.is_empty() {
        let n = queue
            .iter()
            .take(shared.batch_limit())
            .take_while(|i| i.batchable())
            .count();
        if n <= 1 {
            let item = queue.pop_front().expect("not empty");
            let ordered = matches!(item.delivery.lane(), crate::source::Lane::Ordered(_));
            if let Err(stop) = process_alone(shared, item).await {
                if ordered {
                    // What this task still holds may include the lane started over.
                    match queue.iter().position(|i| stop.starts_over(&i.delivery)) {
                        Some(k) => abandon(queue.drain(..k).collect::<Vec<_>>().iter()),
                        None => {
                            abandon(&queue);
                            return LaneEnd::Stopped(stop);
                        }
                    }
                }
                continue;
            }
            // NOTE: while batching is off after a lock conflict every transaction is a lone
            // message's, so batching grows back from these, not from committed batches.
            shared.batch_contended(false);
            continue;
        }
        let mut batch: Vec<Item<D>> = queue.drain(..n).collect();
        let Some(trip) = run_batch(shared, &batch).await else {
            abandon(&batch);
            abandon(&queue);
            return LaneEnd::Stopped(Stop::at(&batch[0].delivery));
        };
        match trip {
            Trip::Committed(claims) => {
                shared.batch_contended(false);
                let settlements = batch.into_iter().zip(claims).map(|(item, claim)| {
                    let verdict = match claim {
                        Claim::New { attempt } => Verdict::Processed(attempt),
                        _ => Verdict::Duplicate,
                    };
                    settle(shared, item.delivery, verdict).instrument(item.span)
                });
                // Every verdict here committed its position with its effects (or is a
                // duplicate): a settlement that fails costs a redelivery, never a skip.
                futures::future::join_all(settlements).await;
            }
            Trip::Cut(k, contended) => {
                if contended {
                    shared.batch_contended(true);
                }
                batch[k].alone = true;
                for item in batch.into_iter().rev() {
                    queue.push_front(item);
                }
            }
            Trip::Unknown(contended) => {
                if contended {
                    shared.batch_contended(true);
                }
                for mut item in batch.into_iter().rev() {
                    item.alone = true;
                    queue.push_front(item);
                }
            }
        }
    }
    LaneEnd::Done
}

/// Marks the spans of deliveries left unsettled (shutdown or a fatal error): every delivery
/// keeps one `txinbox.process` span with an outcome.
fn abandon<'a, D: 'a>(items: impl IntoIterator<Item = &'a Item<D>>) {
    for item in items {
        item.span.record("txinbox.outcome", "abandoned");
    }
}

/// Runs one batch transaction, backing off while the database is unavailable (as the
/// one-message path does before its claim). `None` on shutdown or a fatal error.
async fn run_batch<D: Delivery, St: InboxStore, H: Handler<St::Db>>(
    shared: &Shared<St, H>,
    batch: &[Item<D>],
) -> Option<Trip> {
    // `Err` from a trip: BEGIN, the claim or a duplicate's bookkeeping failed, nothing written.
    // The permit is held for one trip only, never through a backoff sleep.
    with_store(shared, || async {
        let _permit = shared
            .concurrency
            .acquire()
            .await
            .expect("semaphore is never closed");
        batch_attempt(shared, batch).await
    })
    .await
}

/// One batch transaction: claim all, record duplicates, run the handlers of the new ones,
/// confirm, store the positions, COMMIT. `Err` only before any handler ran.
async fn batch_attempt<D: Delivery, St: InboxStore, H: Handler<St::Db>>(
    shared: &Shared<St, H>,
    batch: &[Item<D>],
) -> Result<Trip, StoreError> {
    let store = &shared.store;
    let entries: Vec<Entry<'_>> = batch.iter().map(|i| i.entry(&shared.name)).collect();
    // NOTE: as in `attempt`, BEGIN and COMMIT are never raced against a timer (sqlx #4393).
    let mut tx = store.begin().await?;
    let claims = store.claim_batch(&mut *tx, &entries).await?;
    // Conflicts, redelivered dead letters and undecidable repeats of a key take the
    // one-message path, which records and settles them before anything after them commits.
    let needs_alone = |c: &Claim| !matches!(c, Claim::New { .. } | Claim::Duplicate(InboxStatus::Processed));
    if let Some(k) = claims.iter().position(needs_alone) {
        drop(tx.rollback().await);
        return Ok(Trip::Cut(k, false));
    }
    crate::crash::hit(crate::crash::AFTER_CLAIM);
    let mut new = Vec::with_capacity(batch.len());
    let mut duplicates = Vec::new();
    for (i, claim) in claims.iter().enumerate() {
        match *claim {
            Claim::New { attempt } => new.push((i, attempt)),
            _ => duplicates.push(entries[i]),
        }
    }
    if !duplicates.is_empty() {
        store.record_duplicates(&mut *tx, &duplicates).await?;
    }

    if !new.is_empty() {
        if let Some(handler) = shared.handler.batch() {
            let messages: Vec<BatchMessage<'_>> = new
                .iter()
                .map(|&(i, attempt)| BatchMessage {
                    message: batch[i].delivery.message(),
                    id: entries[i].id,
                    attempt,
                    span: &batch[i].span,
                })
                .collect();
            let mut cx = BatchContext {
                conn: &mut *tx,
                consumer: &shared.name,
            };
            // One duration sample per call: for a batch handler, the whole batch.
            if let Err(error) = run_handler(shared, handler.handle_batch(&mut cx, &messages)).await {
                drop(tx.rollback().await);
                let contended = error.is_contention();
                tracing::debug!(%error, size = batch.len(), "batch handler failed; each message runs alone");
                return Ok(Trip::Unknown(contended));
            }
        } else {
            for &(i, attempt) in &new {
                let item = &batch[i];
                let mut cx = Context {
                    conn: &mut *tx,
                    consumer: &shared.name,
                    id: entries[i].id,
                    attempt,
                };
                let handled = shared.handler.handle(&mut cx, item.delivery.message());
                let result = run_handler(shared, handled).instrument(item.span.clone()).await;
                if let Err(error) = result {
                    drop(tx.rollback().await);
                    let contended = error.is_contention();
                    tracing::debug!(
                        parent: &item.span,
                        contended,
                        size = batch.len(),
                        "handler failed in a batch; the batch is re-run without this message, which runs alone"
                    );
                    return Ok(Trip::Cut(i, contended));
                }
            }
        }
    }
    if new.len() >= 2 {
        crate::crash::hit(crate::crash::BATCH_OPEN);
    }

    // NOTE: as in `finish`: a handler that ignored a failed statement leaves PostgreSQL's
    // transaction aborted, and COMMIT would roll it back without an error. Which handler did it
    // is unknown, so every message of the batch then runs alone.
    let claimed: Vec<Entry<'_>> = new.iter().map(|&(i, _)| entries[i]).collect();
    match store.confirm_batch(&mut *tx, &claimed).await {
        Ok(true) => {}
        Ok(false) | Err(_) => {
            drop(tx.rollback().await);
            tracing::info!(
                size = batch.len(),
                "a batch's transaction was aborted by a statement a handler ignored; each message runs alone"
            );
            return Ok(Trip::Unknown(false));
        }
    }
    // One position per source lane: the last of the batch (every item here is processed or a
    // duplicate, both of which move the position).
    let mut positions: Vec<Position> = Vec::new();
    for item in batch {
        if let Some(p) = item.delivery.position() {
            match positions
                .iter_mut()
                .find(|q| q.source == p.source && q.lane == p.lane)
            {
                Some(q) => *q = p,
                None => positions.push(p),
            }
        }
    }
    for p in &positions {
        if let Err(e) = store.save_position(&mut *tx, &shared.name, p).await {
            drop(tx.rollback().await);
            tracing::info!(error = %e, "storing a batch's position failed; each message runs alone");
            return Ok(Trip::Unknown(e.is_contention()));
        }
    }
    crate::crash::hit(crate::crash::AFTER_HANDLER);
    let started = Instant::now();
    if let Err(e) = store.commit(tx).await {
        // Outcome unknown: never acked. Alone, each message goes through the claim again and
        // becomes a duplicate if this COMMIT did succeed.
        tracing::info!(error = %e, size = batch.len(), "a batch's COMMIT failed; each message runs alone");
        return Ok(Trip::Unknown(e.is_contention()));
    }
    shared
        .metrics
        .commit_duration
        .record(started.elapsed().as_secs_f64());
    crate::crash::hit(crate::crash::AFTER_COMMIT);
    Ok(Trip::Committed(claims))
}

/// Runs the database side to a verdict. `key`: the ID and fingerprint [`Item::new`] derived,
/// `None` if the message has no usable ID or is too large (dead-lettered here, with the reason).
/// `None` returned: shutdown (or a fatal error) came first and the delivery must stay unsettled.
async fn decide<D: Delivery, St: InboxStore, H: Handler<St::Db>>(
    shared: &Shared<St, H>,
    delivery: &D,
    key: Option<(MessageId, [u8; 32])>,
) -> Option<Verdict> {
    let msg = delivery.message();
    let position = delivery.position();
    if let Some((id, fingerprint)) = key {
        let entry = Entry {
            consumer: &shared.name,
            id: &id,
            fingerprint: &fingerprint,
            origin: msg.origin(),
        };
        return claim_and_run(shared, delivery, &id, entry, position.as_ref()).await;
    }
    let size = message_size(msg);
    if size > shared.max_message_bytes {
        // Nothing beyond the headers is read: the ID only where the strategy finds it there,
        // the fingerprint of the bytes (a canonical form would parse the payload).
        let id = shared.id_strategy.derive_from(msg, false).ok();
        if let Some(id) = &id {
            Span::current().record("messaging.message.id", id.as_str());
        }
        let fingerprint = Fingerprint::PayloadBytes.of(msg);
        let entry = id.as_ref().map(|id| Entry {
            consumer: &shared.name,
            id,
            fingerprint: &fingerprint,
            origin: msg.origin(),
        });
        let error = format!(
            "message is {size} bytes (payload and headers); the limit is {} (Consumer::max_message_bytes)",
            shared.max_message_bytes
        );
        return dead_letter(shared, delivery, entry, DeadLetterReason::TooLarge, &error, 0).await;
    }
    let id = match shared.id_strategy.derive(msg) {
        Ok(id) => id,
        Err(e) => return dead_letter(shared, delivery, None, e.reason(), &e.to_string(), 0).await,
    };
    Span::current().record("messaging.message.id", id.as_str());
    let fingerprint = shared.fingerprint.of(msg);
    let entry = Entry {
        consumer: &shared.name,
        id: &id,
        fingerprint: &fingerprint,
        origin: msg.origin(),
    };
    claim_and_run(shared, delivery, &id, entry, position.as_ref()).await
}

/// Payload plus headers, in bytes: what [`ConsumerBuilder::max_message_bytes`](super::ConsumerBuilder::max_message_bytes) limits.
fn message_size(msg: &crate::message::Message) -> usize {
    msg.payload().len() + msg.headers().byte_len()
}

/// Claims and runs a message with a usable ID through its transaction until a verdict: backs
/// off while the database is unavailable, retries in place or hands back a retry, dead-letters.
async fn claim_and_run<D: Delivery, St: InboxStore, H: Handler<St::Db>>(
    shared: &Shared<St, H>,
    delivery: &D,
    id: &MessageId,
    entry: Entry<'_>,
    position: Option<&Position>,
) -> Option<Verdict> {
    let mut store_failures = 0;
    let mut conflicts = 0;
    // Set while this message keeps losing lock conflicts: counted in the `contended` gauge
    // until it leaves this function, however it leaves.
    let mut _contended: Option<GaugeGuard<'_>> = None;
    loop {
        // The concurrency permit bounds open transactions, so it is held for one trip only,
        // never through a backoff sleep: a lane waiting to retry does not block other lanes.
        let permit = shared
            .concurrency
            .acquire()
            .await
            .expect("semaphore is never closed");
        let outcome = attempt(shared, delivery, id, &entry, position).await;
        drop(permit);
        let outcome = match outcome {
            Ok(outcome) => {
                shared.set_healthy(true);
                store_failures = 0;
                outcome
            }
            Err(e) => {
                // BEGIN or the claim failed: nothing was written, nothing is settled.
                store_failures += 1;
                store_unavailable(shared, e, store_failures)?;
                if !shared.sleep(store_backoff(store_failures)).await {
                    return None;
                }
                continue;
            }
        };
        match outcome {
            Attempt::Committed(attempt) => return Some(Verdict::Processed(attempt)),
            Attempt::Duplicate => return Some(Verdict::Duplicate),
            Attempt::DeadLetteredBefore => {
                let earlier =
                    with_store(shared, || shared.store.dead_letter_of(&shared.name, id.as_str())).await?;
                let (reason, error) = earlier.unwrap_or_else(|| ("permanent_error".into(), String::new()));
                return Some(Verdict::DeadLetterAgain(DeadLetter {
                    reason: DeadLetterReason::parse(&reason).unwrap_or(DeadLetterReason::Permanent),
                    error,
                }));
            }
            Attempt::Conflict => {
                shared.metrics.conflicts.increment(1);
                let error = format!(
                    "message ID {id} was already seen with a different payload fingerprint; the handler was not run"
                );
                return dead_letter(
                    shared,
                    delivery,
                    Some(entry),
                    DeadLetterReason::Conflict,
                    &error,
                    0,
                )
                .await;
            }
            Attempt::Failed { error, .. } if error.is_contention() => {
                // A lock conflict is not the message's fault: re-run it without counting an
                // attempt (a hot row must not push good messages into the dead letters), after
                // a growing backoff so the transactions that collided drift apart.
                conflicts += 1;
                shared.metrics.contention_retries.increment(1);
                if conflicts == 1 {
                    // Once per message: a message that keeps losing (a row locked elsewhere
                    // for long) must not keep batching off for every other lane.
                    shared.batch_contended(true);
                    _contended = Some(GaugeGuard::new(&shared.metrics.contended));
                }
                let delay = contention_backoff(conflicts);
                if conflicts % 20 == 0 {
                    tracing::warn!(conflicts, %error, "still losing lock conflicts; its lane waits; re-running without counting an attempt");
                } else {
                    tracing::debug!(conflicts, %error, ?delay, "lost a lock conflict; re-running without counting an attempt");
                }
                if !shared.sleep(delay).await {
                    return None;
                }
            }
            Attempt::Failed { attempt, error } => {
                let text = clean_text(&error.to_string());
                if error.is_permanent() {
                    tracing::debug!(attempt, error = %text, "handler failed permanently");
                    return dead_letter(shared, delivery, Some(entry), error.reason(), &text, attempt).await;
                }
                if shared.retry.exhausted(attempt) {
                    tracing::warn!(attempt, error = %text, "handler failed; attempts exhausted");
                    let reason = DeadLetterReason::AttemptsExhausted;
                    return dead_letter(shared, delivery, Some(entry), reason, &text, attempt).await;
                }
                let delay = shared.retry.delay(attempt, error.requested_delay());
                tracing::info!(attempt, error = %text, ?delay, "handler failed transiently; will retry");
                // Count the attempt in its own transaction. If the key became terminal meanwhile
                // (another consumer finished it), the retry will find a duplicate.
                with_store(shared, || shared.store.record_failure(&entry, &text)).await?;
                shared.metrics.retries.increment(1);
                match shared.retry_mode {
                    RetryMode::Redeliver => return Some(Verdict::Retry(delay, attempt)),
                    RetryMode::InPlace => {
                        if !shared.sleep(delay).await {
                            return None;
                        }
                    }
                }
            }
        }
    }
}

/// One trip through the message transaction. `Err` only for BEGIN and the claim, before
/// anything is written; every later failure (the handler's, or the database's at
/// `save_position`, `confirm` or COMMIT) is an [`Attempt::Failed`] that counts as an attempt,
/// so a message that cannot commit (a deferred constraint, a handler outliving
/// `idle_in_transaction_session_timeout`) ends in a dead letter instead of looping or stopping
/// the consumer. An unknown COMMIT outcome is safe there: if it did commit, counting the
/// attempt finds the key terminal and the next trip finds a duplicate.
async fn attempt<D: Delivery, St: InboxStore, H: Handler<St::Db>>(
    shared: &Shared<St, H>,
    delivery: &D,
    id: &MessageId,
    entry: &Entry<'_>,
    position: Option<&Position>,
) -> Result<Attempt, StoreError> {
    let store = &shared.store;
    // NOTE: never wrap begin/commit in a timeout or select!: a cancelled BEGIN can leave a
    // pooled connection inside a transaction (sqlx #4393), a cancelled COMMIT has an unknown
    // outcome. Server-side timeouts bound them instead.
    let mut tx = store.begin().await?;
    let attempt = match store.claim(&mut *tx, entry).await? {
        Claim::New { attempt } => attempt,
        Claim::Duplicate(InboxStatus::DeadLettered) => {
            // No position: it moves only once the broker has taken this delivery's dead letter.
            drop(tx.rollback().await);
            return Ok(Attempt::DeadLetteredBefore);
        }
        Claim::Duplicate(_) => {
            store
                .record_duplicates(&mut *tx, std::slice::from_ref(entry))
                .await?;
            if let Some(p) = position {
                store.save_position(&mut *tx, &shared.name, p).await?;
            }
            store.commit(tx).await?;
            return Ok(Attempt::Duplicate);
        }
        Claim::Conflict => {
            drop(tx.rollback().await);
            return Ok(Attempt::Conflict);
        }
    };
    crate::crash::hit(crate::crash::AFTER_CLAIM);

    let mut cx = Context {
        conn: &mut *tx,
        consumer: &shared.name,
        id,
        attempt,
    };
    let error = match run_handler(shared, shared.handler.handle(&mut cx, delivery.message())).await {
        Ok(()) => match finish(shared, tx, entry, position).await {
            Ok(()) => {
                crate::crash::hit(crate::crash::AFTER_COMMIT);
                return Ok(Attempt::Committed(attempt));
            }
            Err(error) => error,
        },
        Err(error) => {
            // Roll back explicitly rather than on drop, so the connection is clean before it
            // returns to the pool. If the rollback fails the connection is closed.
            drop(tx.rollback().await);
            error
        }
    };
    Ok(Attempt::Failed { attempt, error })
}

/// Confirms the claimed row is still in the transaction, stores the position and commits.
async fn finish<St: InboxStore, H>(
    shared: &Shared<St, H>,
    mut tx: sqlx::Transaction<'static, St::Db>,
    entry: &Entry<'_>,
    position: Option<&Position>,
) -> Result<(), HandlerError> {
    let store = &shared.store;
    let failed = |stage: &'static str, error: StoreError| HandlerError::transient(Finishing { stage, error });
    // NOTE: without this check, a handler that ignored a failed statement would make
    // PostgreSQL roll back at COMMIT without reporting an error, and the message would be
    // acked with nothing committed.
    match store.confirm(&mut *tx, entry).await {
        Ok(true) => {}
        Ok(false) => {
            drop(tx.rollback().await);
            return Err(HandlerError::transient(
                "the handler's transaction was aborted (a failed statement whose error the handler \
                 ignored) or ended by the handler; nothing was committed",
            ));
        }
        Err(e) => {
            drop(tx.rollback().await);
            return Err(failed("checking the transaction before COMMIT failed", e));
        }
    }
    if let Some(p) = position {
        if let Err(e) = store.save_position(&mut *tx, &shared.name, p).await {
            drop(tx.rollback().await);
            return Err(failed("storing the position failed", e));
        }
    }
    crate::crash::hit(crate::crash::AFTER_HANDLER);
    let started = Instant::now();
    store
        .commit(tx)
        .await
        .map_err(|e| failed("COMMIT failed (outcome unknown; not acknowledged)", e))?;
    shared
        .metrics
        .commit_duration
        .record(started.elapsed().as_secs_f64());
    Ok(())
}

/// A store failure while finishing a message's transaction (the check before COMMIT, the
/// position, COMMIT itself), kept as the error's source so a lock conflict is recognised as
/// one ([`HandlerError::is_contention`]).
#[derive(Debug)]
struct Finishing {
    stage: &'static str,
    error: StoreError,
}

impl std::fmt::Display for Finishing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.stage, self.error)
    }
}

impl std::error::Error for Finishing {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// Records a dead letter (retrying while the database is unavailable) and returns the verdict.
async fn dead_letter<D: Delivery, St: InboxStore, H: Handler<St::Db>>(
    shared: &Shared<St, H>,
    delivery: &D,
    entry: Option<Entry<'_>>,
    reason: DeadLetterReason,
    error: &str,
    attempts: u32,
) -> Option<Verdict> {
    let record = DeadLetterRecord {
        consumer: &shared.name,
        entry,
        message: delivery.message(),
        reason,
        error,
        attempts,
        payload_limit: shared.dead_letter_payload_limit,
    };
    let dead = |reason| {
        Some(Verdict::DeadLetter(
            DeadLetter {
                reason,
                error: error.to_owned(),
            },
            attempts,
        ))
    };
    match with_store(shared, || shared.store.dead_letter(&record)).await? {
        DeadLetterOutcome::Recorded | DeadLetterOutcome::AlreadyDeadLettered => dead(reason),
        DeadLetterOutcome::RecordedAsConflict => {
            shared.metrics.conflicts.increment(1);
            dead(DeadLetterReason::Conflict)
        }
        DeadLetterOutcome::AlreadyProcessed => Some(Verdict::Duplicate),
    }
}

/// Runs a short store operation until it succeeds, backing off while the database is
/// unavailable. `None` on shutdown or a fatal error.
async fn with_store<St, H, T, F, Fut>(shared: &Shared<St, H>, mut op: F) -> Option<T>
where
    St: InboxStore,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut failures = 0;
    loop {
        match op().await {
            Ok(v) => {
                shared.set_healthy(true);
                return Some(v);
            }
            Err(e) => {
                failures += 1;
                store_unavailable(shared, e, failures)?;
                if !shared.sleep(store_backoff(failures)).await {
                    return None;
                }
            }
        }
    }
}

/// Consecutive "busy" failures of one operation (a saturated pool, a statement timeout) after
/// which the database is reported unavailable: with the backoff between them (100 ms doubling),
/// some seconds plus six acquire timeouts.
const BUSY_BEFORE_OUTAGE: u32 = 6;

/// Pauses intake while the database is unavailable; stops the consumer on a fatal error
/// (`None`); contention only backs off the message, as does a busy database until it has been
/// busy for [`BUSY_BEFORE_OUTAGE`] tries.
fn store_unavailable<St, H>(shared: &Shared<St, H>, e: StoreError, failures: u32) -> Option<()> {
    if !e.is_transient() {
        shared.fail(Error::Store(e));
        return None;
    }
    if !e.is_unavailable() && failures < BUSY_BEFORE_OUTAGE {
        // A lock conflict, a timeout, a saturated pool: the database is up. This message backs
        // off, intake goes on, and it is not counted or reported as an outage.
        tracing::info!(error = %e, "inbox transaction could not run now; backing off");
        return Some(());
    }
    if !e.is_unavailable() && failures == BUSY_BEFORE_OUTAGE {
        // Busy for this long looks like an outage from here, and may be one: a server that
        // stopped answering leaves every pooled connection stuck in its transaction, so the
        // pool is "full" until TCP gives up. Pause intake and say so.
        tracing::warn!(error = %e, failures, "inbox database busy for too long; treating it as unavailable");
    }
    shared.metrics.store_errors.increment(1);
    if failures == 1 {
        tracing::warn!(error = %e, "inbox database unavailable; backing off");
    }
    shared.set_healthy(false);
    Some(())
}

/// Settles `delivery` with the broker as `verdict` says. `Err` if its lane must stop here: the
/// broker did not take a settlement whose position the database does not hold (a dead letter
/// or a retry of a delivery with a position). The next delivery of the lane would
/// commit its own position, past this one, and a restart would skip it; stopped, the lane
/// runs again when the source delivers this one again.
async fn settle<D: Delivery, St: InboxStore, H: Handler<St::Db>>(
    shared: &Shared<St, H>,
    delivery: D,
    verdict: Verdict,
) -> Result<(), Stop> {
    let metrics = &shared.metrics;
    let (outcome, settlement, attempt) = match verdict {
        Verdict::Processed(attempt) => {
            metrics.processed.increment(1);
            ("processed", Settlement::Ack, attempt)
        }
        Verdict::Duplicate => {
            metrics.duplicates.increment(1);
            ("duplicate", Settlement::Ack, 0)
        }
        Verdict::Retry(after, attempt) => ("retry", Settlement::Retry { after }, attempt),
        Verdict::DeadLetterAgain(dl) => {
            metrics.dead_letter(dl.reason);
            ("dead_lettered_again", Settlement::DeadLetter(dl), 0)
        }
        Verdict::DeadLetter(dl, attempt) => {
            metrics.dead_letter(dl.reason);
            tracing::warn!(reason = %dl.reason, error = %dl.error, "dead-lettered");
            ("dead_lettered", Settlement::DeadLetter(dl), attempt)
        }
    };
    // NOTE: each field once: a formatting subscriber prints every record of a field.
    let span = Span::current();
    if attempt > 0 {
        span.record("txinbox.attempt", attempt);
    }
    span.record("txinbox.outcome", outcome);
    // Processed and duplicate deliveries committed their position with their effects; a retry
    // or a dead letter did not. A dead letter's moves once the broker has its copy (see below).
    let pending = match settlement {
        Settlement::Ack => None,
        _ => delivery.position(),
    };
    let stop = pending.as_ref().map(|p| Stop {
        next: Some(p.next),
        assignment: delivery.assignment(),
    });
    let dead_letter_position = pending.filter(|_| matches!(settlement, Settlement::DeadLetter(_)));
    // A settlement the broker cannot take (a dead-letter topic that is down, say) may retry for
    // long; once shutdown has begun it gets SETTLE_GRACE more, then is dropped, which its
    // contract allows: the broker redelivers and the inbox deduplicates.
    let settled = tokio::select! {
        r = delivery.settle(settlement) => r,
        _ = async {
            shared.shutdown.cancelled().await;
            tokio::time::sleep(SETTLE_GRACE).await;
        } => Err(SettleError::new(format!(
            "still pending {SETTLE_GRACE:?} after shutdown began; abandoned"
        ))),
    };
    if let Err(e) = settled {
        metrics.ack_failures.increment(1);
        if let Some(stop) = stop {
            // Nothing after it on its lane may commit a position past it: stop the lane until
            // the source delivers this one again (on Kafka: the partition assigned again).
            tracing::warn!(error = %e, outcome, "the broker did not take the settlement; its lane stops until the message is delivered again");
            return Err(stop);
        }
        // The database side is final; the broker will redeliver and the inbox deduplicates.
        // Safe by design, so info, not warn: the counter is what to alert on (a burst means the
        // broker connection is flapping).
        tracing::info!(error = %e, outcome, "settlement did not reach the broker; the redelivery will be a duplicate");
        return Ok(());
    }
    tracing::debug!(outcome, "settled");
    if let Some(position) = dead_letter_position {
        // The dead letter was recorded without moving the position (a crash before the broker
        // confirmed its copy must show the record again). Now the broker has the copy: move the
        // position past it, so a restart does not read a run of dead letters again. Still
        // before the lane's next message, so positions keep their order. A crash between the
        // broker's confirmation and this commit reads the record once more: its dead letter is
        // recorded already (nothing new is written) and the copy is sent again.
        //
        // Forward only: once the broker has the copy, the lane may be someone else's (a Kafka
        // partition moved on), and a late save must not take its position back.
        let saved = with_store(shared, || async {
            let mut tx = shared.store.begin().await?;
            shared
                .store
                .advance_position(&mut *tx, &shared.name, &position)
                .await?;
            shared.store.commit(tx).await
        })
        .await;
        if saved.is_none() {
            tracing::debug!("the position after a dead letter was not stored (shutdown); the restart sends its copy again");
        }
    }
    Ok(())
}

/// Runs a handler call: a panic becomes a transient error (its transaction is rolled back by
/// the caller), and the call's duration is recorded as one `handler_duration` sample.
async fn run_handler<St, H>(
    shared: &Shared<St, H>,
    call: impl std::future::Future<Output = Result<(), HandlerError>>,
) -> Result<(), HandlerError> {
    let started = Instant::now();
    let result = AssertUnwindSafe(call).catch_unwind().await;
    shared
        .metrics
        .handler_duration
        .record(started.elapsed().as_secs_f64());
    result.unwrap_or_else(|panic| {
        Err(HandlerError::transient(format!(
            "handler panicked: {}",
            panic_message(&*panic)
        )))
    })
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// Holds one unit of a gauge while alive.
struct GaugeGuard<'a>(&'a metrics::Gauge);

impl<'a> GaugeGuard<'a> {
    fn new(gauge: &'a metrics::Gauge) -> Self {
        gauge.increment(1.0);
        GaugeGuard(gauge)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn panic_messages_are_extracted() {
        let p = std::panic::catch_unwind(|| panic!("boom {}", 1)).unwrap_err();
        assert_eq!(super::panic_message(&*p), "boom 1");
    }
}
