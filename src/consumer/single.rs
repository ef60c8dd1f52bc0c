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

use std::time::Instant;

use tracing::{Instrument, Span};

use super::backoff::{contention_backoff, store_backoff, store_unavailable, with_store};
use super::batch::Item;
use super::call::run_handler;
use super::scheduler::Stop;
use super::settle::Verdict;
use super::Shared;
use crate::dead_letter::{DeadLetter, DeadLetterReason};
use crate::handler::{Context, Handler, HandlerError};
use crate::message::{Fingerprint, MessageId};
use crate::position::Position;
use crate::source::{Delivery, RetryMode};
use crate::store::{clean_text, Claim, Entry, InboxStatus, InboxStore, StoreError};
use crate::tracked::TrackedTransaction;

/// The result of one trip through the message transaction.
enum Attempt {
    Committed(u32),
    Duplicate,
    DeadLetteredBefore,
    Conflict,
    Failed { attempt: u32, error: HandlerError },
}

impl<St, H> Shared<St, H>
where
    St: InboxStore,
    H: Handler<St::Db>,
{
    /// Processes one delivery alone, to its settlement, in `span`. `Err` if its lane must not go on
    /// without it: it was left unsettled (shutdown or a fatal error came first), or the broker did
    /// not take a settlement the database does not record the position of (see [`settle`](Self::settle)).
    pub(super) async fn process_alone<D: Delivery>(&self, item: Item<D>) -> Result<(), Stop> {
        let Item {
            delivery, span, key, ..
        } = item;
        async move {
            let Some(verdict) = self.decide(&delivery, key).await else {
                tracing::Span::current().record("txinbox.outcome", "abandoned");
                tracing::debug!("left unsettled at shutdown; the broker will redeliver it");
                return Err(Stop::at(&delivery));
            };
            self.settle(delivery, verdict).await
        }
        .instrument(span)
        .await
    }

    /// Runs the database side to a verdict. `key`: the ID and fingerprint [`Item::new`] derived,
    /// `None` if the message has no usable ID or is too large (dead-lettered here, with the reason).
    /// `None` returned: shutdown (or a fatal error) came first and the delivery must stay unsettled.
    async fn decide<D: Delivery>(&self, delivery: &D, key: Option<(MessageId, [u8; 32])>) -> Option<Verdict> {
        let msg = delivery.message();
        if let Some((id, fingerprint)) = key {
            let entry = Entry {
                consumer: &self.name,
                id: &id,
                fingerprint: &fingerprint,
                origin: msg.origin(),
            };
            return self.claim_and_run(delivery, &id, entry).await;
        }
        let size = message_size(msg);
        if size > self.max_message_bytes {
            // Nothing beyond the headers is read: the ID only where the strategy finds it there,
            // the fingerprint of the bytes (a canonical form would parse the payload).
            let id = self.id_strategy.derive_from(msg, false).ok();
            if let Some(id) = &id {
                Span::current().record("messaging.message.id", id.as_str());
            }
            let fingerprint = Fingerprint::PayloadBytes.of(msg);
            let entry = id.as_ref().map(|id| Entry {
                consumer: &self.name,
                id,
                fingerprint: &fingerprint,
                origin: msg.origin(),
            });
            let error = format!(
            "message is {size} bytes (payload and headers); the limit is {} (Consumer::max_message_bytes)",
            self.max_message_bytes
        );
            return self
                .dead_letter(delivery, entry, DeadLetterReason::TooLarge, &error, 0)
                .await;
        }
        let id = match self.id_strategy.derive(msg) {
            Ok(id) => id,
            Err(e) => {
                return self
                    .dead_letter(delivery, None, e.reason(), &e.to_string(), 0)
                    .await
            }
        };
        Span::current().record("messaging.message.id", id.as_str());
        let fingerprint = self.fingerprint.of(msg);
        let entry = Entry {
            consumer: &self.name,
            id: &id,
            fingerprint: &fingerprint,
            origin: msg.origin(),
        };
        self.claim_and_run(delivery, &id, entry).await
    }

    /// Claims and runs a message with a usable ID through its transaction until a verdict: backs
    /// off while the database is unavailable, retries in place or hands back a retry, dead-letters.
    async fn claim_and_run<D: Delivery>(
        &self,
        delivery: &D,
        id: &MessageId,
        entry: Entry<'_>,
    ) -> Option<Verdict> {
        let mut store_failures = 0;
        let mut conflicts = 0;
        // Set while this message keeps losing lock conflicts: counted in the `contended` gauge
        // until it leaves this function, however it leaves.
        let mut _contended: Option<GaugeGuard<'_>> = None;
        loop {
            // The concurrency permit bounds open transactions, so it is held for one trip only,
            // never through a backoff sleep: a lane waiting to retry does not block other lanes.
            let permit = self
                .concurrency
                .acquire()
                .await
                .expect("semaphore is never closed");
            let outcome = self.attempt(delivery, id, &entry).await;
            drop(permit);
            // The database went away under the message (its session ended, the server shuts
            // down, the connection broke, in the handler or at COMMIT): an outage like a failed
            // BEGIN, not the message's fault. Rolled back; no attempt is counted.
            let outcome = outcome.and_then(|attempt| match attempt {
                Attempt::Failed { error, .. } if error.is_unavailable() => {
                    Err(StoreError::transient(error.into_source()))
                }
                attempt => Ok(attempt),
            });
            let outcome = match outcome {
                Ok(outcome) => {
                    self.set_healthy(true);
                    store_failures = 0;
                    outcome
                }
                Err(e) => {
                    // Nothing was committed, nothing is settled.
                    store_failures += 1;
                    store_unavailable(self, e, store_failures)?;
                    if !self.sleep(store_backoff(store_failures)).await {
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
                        with_store(self, || self.store.dead_letter_of(&self.name, id.as_str())).await?;
                    let (reason, error) =
                        earlier.unwrap_or_else(|| ("permanent_error".into(), String::new()));
                    return Some(Verdict::DeadLetterAgain(DeadLetter {
                        reason: DeadLetterReason::parse(&reason).unwrap_or(DeadLetterReason::Permanent),
                        error,
                    }));
                }
                Attempt::Conflict => {
                    self.metrics.conflicts.increment(1);
                    let error = format!(
                    "message ID {id} was already seen with a different payload fingerprint; the handler was not run"
                );
                    return self
                        .dead_letter(delivery, Some(entry), DeadLetterReason::Conflict, &error, 0)
                        .await;
                }
                Attempt::Failed { error, .. } if error.is_contention() => {
                    // A lock conflict is not the message's fault: re-run it without counting an
                    // attempt (a hot row must not push good messages into the dead letters), after
                    // a growing backoff so the transactions that collided drift apart.
                    conflicts += 1;
                    self.metrics.contention_retries.increment(1);
                    if conflicts == 1 {
                        // Once per message: a message that keeps losing (a row locked elsewhere
                        // for long) must not keep batching off for every other lane.
                        self.batch_contended(true);
                        _contended = Some(GaugeGuard::new(&self.metrics.contended));
                    }
                    let delay = contention_backoff(conflicts);
                    if conflicts % 20 == 0 {
                        tracing::warn!(conflicts, %error, "still losing lock conflicts; its lane waits; re-running without counting an attempt");
                    } else {
                        tracing::debug!(conflicts, %error, ?delay, "lost a lock conflict; re-running without counting an attempt");
                    }
                    if !self.sleep(delay).await {
                        return None;
                    }
                }
                Attempt::Failed { attempt, error } => {
                    let text = clean_text(&error.to_string());
                    if error.is_permanent() {
                        tracing::debug!(attempt, error = %text, "handler failed permanently");
                        return self
                            .dead_letter(delivery, Some(entry), error.reason(), &text, attempt)
                            .await;
                    }
                    if self.retry.exhausted(attempt) {
                        tracing::warn!(attempt, error = %text, "handler failed; attempts exhausted");
                        let reason = DeadLetterReason::AttemptsExhausted;
                        return self
                            .dead_letter(delivery, Some(entry), reason, &text, attempt)
                            .await;
                    }
                    let delay = self.retry.delay(attempt, error.requested_delay());
                    tracing::info!(attempt, error = %text, ?delay, "handler failed transiently; will retry");
                    // Count the attempt in its own transaction. If the key became terminal meanwhile
                    // (another consumer finished it), the retry will find a duplicate.
                    with_store(self, || self.store.record_failure(&entry, &text)).await?;
                    self.metrics.retries.increment(1);
                    match self.retry_mode {
                        RetryMode::Redeliver => return Some(Verdict::Retry(delay, attempt)),
                        RetryMode::InPlace => {
                            if !self.sleep(delay).await {
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
    /// `save_position`, `confirm` or COMMIT) is an [`Attempt::Failed`]. It counts as an attempt,
    /// so a message that cannot commit (a deferred constraint, a handler outliving
    /// `idle_in_transaction_session_timeout`) ends in a dead letter instead of looping or stopping
    /// the consumer — unless it is a lock conflict or the database being unavailable, which the
    /// caller re-runs uncounted. An unknown COMMIT outcome is safe: if it did commit, the next
    /// trip (or counting the attempt) finds the key terminal: a duplicate.
    async fn attempt<D: Delivery>(
        &self,
        delivery: &D,
        id: &MessageId,
        entry: &Entry<'_>,
    ) -> Result<Attempt, StoreError> {
        let store = &self.store;
        // NOTE: never wrap begin/commit in a timeout or select!: a cancelled BEGIN can leave a
        // pooled connection inside a transaction (sqlx #4393), a cancelled COMMIT has an unknown
        // outcome. Server-side timeouts bound them instead.
        let mut tx = store.begin().await?;
        let attempt = match store.claim(&mut *tx, entry).await? {
            Claim::New { attempt } => attempt,
            Claim::Duplicate(InboxStatus::DeadLettered) => {
                // No position: it moves only once the broker has taken this delivery's dead letter.
                self.store.rollback(tx).await;
                return Ok(Attempt::DeadLetteredBefore);
            }
            Claim::Duplicate(_) => {
                store
                    .record_duplicates(&mut *tx, std::slice::from_ref(entry))
                    .await?;
                // Asked now, not when the delivery arrived: under key ordering the settled prefix
                // it answers with moves on while the message waits and runs.
                if let Some(p) = delivery.position_to_store() {
                    store.save_position(&mut *tx, &self.name, &p).await?;
                }
                store.commit(tx).await?;
                return Ok(Attempt::Duplicate);
            }
            Claim::Conflict => {
                self.store.rollback(tx).await;
                return Ok(Attempt::Conflict);
            }
        };
        crate::crash::hit(crate::crash::AFTER_CLAIM);

        let mut tx = TrackedTransaction::new(tx);
        let mut cx = Context {
            conn: &mut tx,
            consumer: &self.name,
            id,
            attempt,
        };
        let call_started = std::time::Instant::now();
        let handled = run_handler(self, self.handler.handle(&mut cx, delivery.message())).await;
        if self.batch_max_duration.is_some() {
            // A lone message's handler sets the pace too: the first burst after quiet traffic
            // is then taken in bounded portions (see `Shared::batch_take`).
            self.note_handler_pace(call_started.elapsed(), 1);
        }
        let error = match handled {
            Ok(()) => match self.finish(tx, entry, delivery.position_to_store()).await {
                Ok(()) => {
                    crate::crash::hit(crate::crash::AFTER_COMMIT);
                    return Ok(Attempt::Committed(attempt));
                }
                Err(error) => error,
            },
            Err(error) => {
                // Roll back explicitly rather than on drop, and through the store, so the
                // connection is clean before it returns to the pool, even if the handler ended
                // the transaction itself (see `InboxStore::rollback`).
                self.store.rollback(tx.into_inner()).await;
                error
            }
        };
        Ok(Attempt::Failed { attempt, error })
    }

    /// Checks that no statement of the handler failed and that the claimed row is still in the
    /// transaction, stores the position and commits.
    async fn finish(
        &self,
        tx: TrackedTransaction<St::Db>,
        entry: &Entry<'_>,
        position: Option<Position>,
    ) -> Result<(), HandlerError> {
        let store = &self.store;
        let failed =
            |stage: &'static str, error: StoreError| HandlerError::transient(Finishing { stage, error });
        // NOTE: a handler that ignored a failed statement: SQLite would commit what succeeded
        // before it (it does not abort the transaction).
        let mut tx = match tx.checked() {
            Ok(tx) => tx,
            Err((tx, failed)) => {
                self.store.rollback(tx).await;
                return Err(HandlerError::transient(failed));
            }
        };
        // NOTE: without this check, a handler that ended the transaction itself, or ignored a
        // failed statement run on the connection directly, would make PostgreSQL roll back at
        // COMMIT without reporting an error, and the message would be acked with nothing
        // committed.
        let positions = position.as_slice();
        match store
            .confirm_and_save_positions(&mut *tx, std::slice::from_ref(entry), &self.name, positions)
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                self.store.rollback(tx).await;
                return Err(HandlerError::transient(
                    "the handler's transaction was aborted (a failed statement whose error the handler \
                 ignored) or ended by the handler; nothing was committed",
                ));
            }
            Err(e) => {
                self.store.rollback(tx).await;
                return Err(failed(
                    "checking the transaction before COMMIT (and storing the position) failed",
                    e,
                ));
            }
        }
        crate::crash::hit(crate::crash::AFTER_HANDLER);
        let started = Instant::now();
        store
            .commit(tx)
            .await
            .map_err(|e| failed("COMMIT failed (outcome unknown; not acknowledged)", e))?;
        self.metrics
            .commit_duration
            .record(started.elapsed().as_secs_f64());
        Ok(())
    }
}

/// Payload plus headers, in bytes: what [`ConsumerBuilder::max_message_bytes`](super::ConsumerBuilder::max_message_bytes) limits.
pub(super) fn message_size(msg: &crate::message::Message) -> usize {
    msg.payload().len() + msg.headers().byte_len()
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
