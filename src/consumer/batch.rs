//! The micro-batch path: several deliveries of one lane in one transaction, and how a batch
//! that fails is cut and re-run. Every lane task starts here; what cannot share a transaction
//! goes to [`single`](super::single).

use std::collections::VecDeque;
use std::time::Instant;

use tracing::{field, Instrument, Span};

use super::backoff::with_store;
use super::call::run_handler;
use super::scheduler::{LaneEnd, Stop};
use super::settle::Verdict;
use super::single::message_size;
use super::Shared;
use crate::handler::{BatchContext, BatchMessage, Context, Handler};
use crate::message::MessageId;
use crate::position::Position;
use crate::source::Delivery;
use crate::store::{Claim, Entry, InboxStatus, InboxStore, StoreError};
use crate::tracked::TrackedTransaction;

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

/// A delivery of a batch, with what the batch claim needs.
pub(super) struct Item<D> {
    pub(super) delivery: D,
    pub(super) span: Span,
    /// ID and fingerprint; `None` if the message cannot be claimed at all (no usable ID, too
    /// large): the one-message path dead-letters it.
    pub(super) key: Option<(MessageId, [u8; 32])>,
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

impl<St, H> Shared<St, H>
where
    St: InboxStore,
    H: Handler<St::Db>,
{
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
    pub(super) async fn process_batch<D: Delivery>(&self, deliveries: Vec<D>) -> LaneEnd {
        let mut queue: VecDeque<Item<D>> = deliveries.into_iter().map(|d| Item::new(self, d)).collect();
        while !queue.is_empty() {
            let n = queue
                .iter()
                .take(self.batch_limit())
                .take_while(|i| i.batchable())
                .count();
            if n <= 1 {
                let item = queue.pop_front().expect("not empty");
                let ordered = matches!(item.delivery.lane(), crate::source::Lane::Ordered(_));
                if let Err(stop) = self.process_alone(item).await {
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
                self.batch_contended(false);
                continue;
            }
            let mut batch: Vec<Item<D>> = queue.drain(..n).collect();
            let Some(trip) = self.run_batch(&batch).await else {
                abandon(&batch);
                abandon(&queue);
                return LaneEnd::Stopped(Stop::at(&batch[0].delivery));
            };
            match trip {
                Trip::Committed(claims) => {
                    self.batch_contended(false);
                    // A batch bounded by its duration committed the messages it took; the rest
                    // run next, in lane order.
                    for item in batch.split_off(claims.len()).into_iter().rev() {
                        queue.push_front(item);
                    }
                    let settlements = batch.into_iter().zip(claims).map(|(item, claim)| {
                        let verdict = match claim {
                            Claim::New { attempt } => Verdict::Processed(attempt),
                            _ => Verdict::Duplicate,
                        };
                        self.settle(item.delivery, verdict).instrument(item.span)
                    });
                    // Every verdict here committed its position with its effects (or is a
                    // duplicate): a settlement that fails costs a redelivery, never a skip.
                    settle_together(settlements).await;
                }
                Trip::Cut(k, contended) => {
                    if contended {
                        self.batch_contended(true);
                    }
                    batch[k].alone = true;
                    for item in batch.into_iter().rev() {
                        queue.push_front(item);
                    }
                }
                Trip::Unknown(contended) => {
                    if contended {
                        self.batch_contended(true);
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

    /// Runs one batch transaction, backing off while the database is unavailable (as the
    /// one-message path does before its claim). `None` on shutdown or a fatal error.
    async fn run_batch<D: Delivery>(&self, batch: &[Item<D>]) -> Option<Trip> {
        // `Err` from a trip: BEGIN, the claim or a duplicate's bookkeeping failed, nothing written.
        // The permit is held for one trip only, never through a backoff sleep.
        with_store(self, || async {
            let _permit = self
                .concurrency
                .acquire()
                .await
                .expect("semaphore is never closed");
            self.batch_attempt(batch).await
        })
        .await
    }

    /// One batch transaction: claim, record duplicates, run the handlers of the new ones,
    /// confirm, store the positions, COMMIT. `Err` only before any handler ran.
    ///
    /// With [`batch_max_duration`](super::ConsumerBuilder::batch_max_duration) and a
    /// per-message handler, the batch is claimed in chunks, each sized to fit the time left
    /// at the handlers' recent pace ([`Shared::chunk_for`]); once the duration has passed no
    /// further chunk is claimed, and the transaction commits the messages it took. The
    /// committed claims may then be fewer than `batch`: the caller runs the rest next.
    async fn batch_attempt<D: Delivery>(&self, batch: &[Item<D>]) -> Result<Trip, StoreError> {
        let store = &self.store;
        let entries: Vec<Entry<'_>> = batch.iter().map(|i| i.entry(&self.name)).collect();
        // None for a batch handler (see `ConsumerBuilder::build`): it takes the batch in one call.
        let bounded = self.batch_max_duration;
        let started = Instant::now();
        // NOTE: as in `attempt`, BEGIN and COMMIT are never raced against a timer (sqlx #4393).
        let mut tx = store.begin().await?;
        let first = match bounded {
            Some(max) => self.chunk_for(max, batch.len(), 0),
            None => batch.len(),
        };
        let mut claims = store.claim_batch(&mut *tx, &entries[..first]).await?;
        // Conflicts, redelivered dead letters and undecidable repeats of a key take the
        // one-message path, which records and settles them before anything after them commits.
        let needs_alone =
            |c: &Claim| !matches!(c, Claim::New { .. } | Claim::Duplicate(InboxStatus::Processed));
        if let Some(k) = claims.iter().position(needs_alone) {
            self.store.rollback(tx).await;
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

        let mut tx = TrackedTransaction::new(tx);
        if let Some(handler) = self.handler.batch().filter(|_| !new.is_empty()) {
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
                conn: &mut tx,
                consumer: &self.name,
            };
            // One duration sample per call: for a batch handler, the whole batch.
            if let Err(error) = run_handler(self, handler.handle_batch(&mut cx, &messages)).await {
                self.store.rollback(tx.into_inner()).await;
                let contended = error.is_contention();
                tracing::debug!(%error, size = batch.len(), "batch handler failed; each message runs alone");
                return Ok(Trip::Unknown(contended));
            }
        } else {
            // Handlers run one after another; `next` is the next of `new` to run. Unbounded,
            // `new` holds the whole batch's and the loop runs once.
            let (mut next, mut handler_time, mut calls) = (0, std::time::Duration::ZERO, 0u32);
            loop {
                while next < new.len() {
                    let (i, attempt) = new[next];
                    next += 1;
                    let call_started = Instant::now();
                    let item = &batch[i];
                    let mut cx = Context {
                        conn: &mut tx,
                        consumer: &self.name,
                        id: entries[i].id,
                        attempt,
                    };
                    let handled = self.handler.handle(&mut cx, item.delivery.message());
                    let result = run_handler(self, handled).instrument(item.span.clone()).await;
                    if let Err(error) = result {
                        self.store.rollback(tx.into_inner()).await;
                        let contended = error.is_contention();
                        tracing::debug!(
                            parent: &item.span,
                            contended,
                            size = batch.len(),
                            "handler failed in a batch; the batch is re-run without this message, which runs alone"
                        );
                        return Ok(Trip::Cut(i, contended));
                    }
                    if let Some(error) = tx.failed_statement() {
                        tracing::info!(
                            parent: &item.span,
                            error,
                            size = batch.len(),
                            "a statement of a handler failed in a batch and it went on; the batch is re-run without this message, which runs alone"
                        );
                        self.store.rollback(tx.into_inner()).await;
                        return Ok(Trip::Cut(i, false));
                    }
                    handler_time += call_started.elapsed();
                    calls += 1;
                }
                let Some(max) = bounded else { break };
                self.note_handler_pace(handler_time, calls);
                let taken = claims.len();
                let elapsed = started.elapsed();
                if taken == batch.len() || elapsed >= max {
                    break;
                }
                // The duration has not passed: the next chunk, sized to the time left. First,
                // is the transaction still there? A handler may have ended it, and a chunk
                // claimed on a connection in autocommit commits its rows at once: its messages
                // would come back as duplicates, acked without their effects.
                // (The first new key stands for them all, as in `confirm_batch`; none is new:
                // no handler ran.)
                let first_new = match new.first() {
                    Some(&(i, _)) => std::slice::from_ref(&entries[i]),
                    None => &[],
                };
                match store.confirm_batch(&mut *tx, first_new).await {
                    Ok(true) => {}
                    Ok(false) => {
                        self.store.rollback(tx.into_inner()).await;
                        tracing::info!(
                            size = batch.len(),
                            "a batch's transaction ended under its handlers before its next chunk; each message runs alone"
                        );
                        return Ok(Trip::Unknown(false));
                    }
                    Err(e) => {
                        self.store.rollback(tx.into_inner()).await;
                        tracing::info!(error = %e, size = batch.len(), "checking a batch's transaction before its next chunk failed; each message runs alone");
                        return Ok(Trip::Unknown(e.is_contention()));
                    }
                }
                let n = self.chunk_for(max - elapsed, batch.len() - taken, taken);
                let more = match store.claim_batch(&mut *tx, &entries[taken..taken + n]).await {
                    Ok(more) => more,
                    Err(e) => {
                        // Handlers have run: not an `Err` (which would retry the whole
                        // attempt as if nothing had), but each message alone.
                        self.store.rollback(tx.into_inner()).await;
                        tracing::info!(error = %e, size = batch.len(), "claiming a batch's next chunk failed; each message runs alone");
                        return Ok(Trip::Unknown(e.is_contention()));
                    }
                };
                if let Some(k) = more.iter().position(needs_alone) {
                    self.store.rollback(tx.into_inner()).await;
                    return Ok(Trip::Cut(taken + k, false));
                }
                let mut duplicates = Vec::new();
                for (j, claim) in more.iter().enumerate() {
                    match *claim {
                        Claim::New { attempt } => new.push((taken + j, attempt)),
                        _ => duplicates.push(entries[taken + j]),
                    }
                }
                if !duplicates.is_empty() {
                    if let Err(e) = store.record_duplicates(&mut *tx, &duplicates).await {
                        self.store.rollback(tx.into_inner()).await;
                        tracing::info!(error = %e, "recording a batch's duplicates failed; each message runs alone");
                        return Ok(Trip::Unknown(e.is_contention()));
                    }
                }
                claims.extend(more);
            }
        }
        if new.len() >= 2 {
            crate::crash::hit(crate::crash::BATCH_OPEN);
        }

        // A batch handler's failed statement (a handler's was seen above, with its message).
        let mut tx = match tx.checked() {
            Ok(tx) => tx,
            Err((tx, error)) => {
                self.store.rollback(tx).await;
                tracing::info!(%error, size = batch.len(), "each message of the batch runs alone");
                return Ok(Trip::Unknown(false));
            }
        };
        // NOTE: as in `finish`: a handler that ended the transaction, or ignored a failed
        // statement run on the connection directly, leaves PostgreSQL's transaction aborted, and
        // COMMIT would roll it back without an error. Which handler did it is unknown, so every
        // message of the batch then runs alone.
        let claimed: Vec<Entry<'_>> = new.iter().map(|&(i, _)| entries[i]).collect();
        // One position per source lane: the furthest of the batch (every item here is processed
        // or a duplicate, both of which move the position; each item's position counts itself
        // as settled, so the furthest is as true as any). Asked now, after the handlers: under
        // key ordering the settled prefix a delivery answers with moves on while the batch runs.
        // A prefix handed to a transaction that then fails its check is not handed again: the
        // stored position trails (never passes an unsettled offset) until a later transaction
        // or the source's own flush moves it, as after a failed COMMIT.
        let mut positions: Vec<Position> = Vec::new();
        for item in &batch[..claims.len()] {
            if let Some(p) = item.delivery.position_to_store() {
                match positions
                    .iter_mut()
                    .find(|q| q.source == p.source && q.lane == p.lane)
                {
                    Some(q) if q.next < p.next => *q = p,
                    Some(_) => {}
                    None => positions.push(p),
                }
            }
        }
        // In one order in every transaction: two batches of the shared unordered queue holding
        // records of the same partitions would otherwise lock their position rows in opposite
        // orders and deadlock (40P01), as the claim's rows would without its sort.
        positions.sort_by(|a, b| (&a.source, &a.lane).cmp(&(&b.source, &b.lane)));
        match store
            .confirm_and_save_positions(&mut *tx, &claimed, &self.name, &positions)
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                self.store.rollback(tx).await;
                tracing::info!(
                    size = batch.len(),
                    "a batch's transaction was aborted by a statement a handler ignored; each message runs alone"
                );
                return Ok(Trip::Unknown(false));
            }
            Err(e) => {
                self.store.rollback(tx).await;
                tracing::info!(error = %e, "checking a batch's transaction or storing its position failed; each message runs alone");
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
        self.metrics
            .commit_duration
            .record(started.elapsed().as_secs_f64());
        crate::crash::hit(crate::crash::AFTER_COMMIT);
        Ok(Trip::Committed(claims))
    }
}

/// How many settlements [`settle_together`] keeps in one allocation: futures' `join_all` keeps
/// up to 30 that way, and gives each future of a longer list a task allocation of its own.
const SETTLE_GROUP: usize = 30;

/// Runs a batch's settlements side by side, so that an adapter can coalesce them (AMQP sends
/// one `basic.ack(multiple)` for the batch's tags, which needs every ack to be waiting at once).
/// In groups of [`SETTLE_GROUP`], each built in place from `settlements`: a batch of 100 costs a
/// handful of allocations, not one per message, and a settlement's future (hundreds of bytes:
/// it holds its delivery) is not copied from list to list. Returns when every one has returned.
async fn settle_together<F: std::future::Future>(mut settlements: impl ExactSizeIterator<Item = F>) {
    let groups: Vec<_> = (0..settlements.len().div_ceil(SETTLE_GROUP))
        .map(|_| futures::future::join_all(settlements.by_ref().take(SETTLE_GROUP)))
        .collect();
    futures::future::join_all(groups).await;
}

/// Marks the spans of deliveries left unsettled (shutdown or a fatal error): every delivery
/// keeps one `txinbox.process` span with an outcome.
fn abandon<'a, D: 'a>(items: impl IntoIterator<Item = &'a Item<D>>) {
    for item in items {
        item.span.record("txinbox.outcome", "abandoned");
    }
}
