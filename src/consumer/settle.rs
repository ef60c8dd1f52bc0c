//! What the broker is told: the verdict for a delivery, recording a dead letter before the
//! broker hears of it, settling, and when a settlement the broker refused stops the lane.

use std::time::Duration;

use tracing::Span;

use super::backoff::with_store;
use super::scheduler::Stop;
use super::Shared;
use crate::dead_letter::{DeadLetter, DeadLetterReason};
use crate::handler::Handler;
use crate::source::{Delivery, SettleError, Settlement};
use crate::store::{DeadLetterOutcome, DeadLetterRecord, Entry, InboxStore};

/// How long a settlement may still take once shutdown has begun.
const SETTLE_GRACE: Duration = Duration::from_secs(10);

/// What to tell the broker, decided after the database work is done, with the attempt that
/// decided it (recorded on the span once, at settlement; 0 when no handler ran).
pub(super) enum Verdict {
    Processed(u32),
    Duplicate,
    /// A redelivery of a message dead-lettered before: sent to the broker's dead-letter
    /// destination again (its copy may never have been confirmed), not recorded again.
    DeadLetterAgain(DeadLetter),
    Retry(Duration, u32),
    DeadLetter(DeadLetter, u32),
}

impl<St, H> Shared<St, H>
where
    St: InboxStore,
    H: Handler<St::Db>,
{
    /// Records a dead letter (retrying while the database is unavailable) and returns the verdict.
    pub(super) async fn dead_letter<D: Delivery>(
        &self,
        delivery: &D,
        entry: Option<Entry<'_>>,
        reason: DeadLetterReason,
        error: &str,
        attempts: u32,
    ) -> Option<Verdict> {
        let record = DeadLetterRecord {
            consumer: &self.name,
            entry,
            message: delivery.message(),
            reason,
            error,
            attempts,
            payload_limit: self.dead_letter_payload_limit,
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
        match with_store(self, || self.store.dead_letter(&record)).await? {
            DeadLetterOutcome::Recorded | DeadLetterOutcome::AlreadyDeadLettered => dead(reason),
            DeadLetterOutcome::RecordedAsConflict => {
                self.metrics.conflicts.increment(1);
                dead(DeadLetterReason::Conflict)
            }
            DeadLetterOutcome::AlreadyProcessed => Some(Verdict::Duplicate),
        }
    }

    /// Settles `delivery` with the broker as `verdict` says. `Err` if its lane must stop here: the
    /// broker did not take a settlement whose position the database does not hold (a dead letter
    /// or a retry of a delivery with a position). The next delivery of the lane would
    /// commit its own position, past this one, and a restart would skip it; stopped, the lane
    /// runs again when the source delivers this one again.
    pub(super) async fn settle<D: Delivery>(&self, delivery: D, verdict: Verdict) -> Result<(), Stop> {
        let metrics = &self.metrics;
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
        // Counts this delivery as settled: stored only once the broker took the dead letter.
        let dead_letter_position = match settlement {
            Settlement::DeadLetter(_) if pending.is_some() => delivery.position_to_store(),
            _ => None,
        };
        // A settlement the broker cannot take (a dead-letter topic that is down, say) may retry for
        // long; once shutdown has begun it gets SETTLE_GRACE more, then is dropped, which its
        // contract allows: the broker redelivers and the inbox deduplicates.
        //
        // NOTE: most settlements are done at their first poll (a Kafka offset, the memory broker):
        // the grace timer is built, boxed, only for one that is not. A batch holds 100 of these
        // futures at once, and the timer inline tripled each one's size.
        let mut settling = delivery.settle(settlement);
        let settled = match futures::poll!(settling.as_mut()) {
            std::task::Poll::Ready(r) => r,
            std::task::Poll::Pending => {
                let grace = Box::pin(async {
                    self.shutdown.cancelled().await;
                    tokio::time::sleep(SETTLE_GRACE).await;
                });
                tokio::select! {
                    biased;
                    r = settling => r,
                    _ = grace => Err(SettleError::new(format!(
                        "still pending {SETTLE_GRACE:?} after shutdown began; abandoned"
                    ))),
                }
            }
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
            // Boxed: rare, and its store calls would otherwise size every settlement's future.
            Box::pin(self.save_dead_letter_position(position)).await;
        }
        Ok(())
    }

    /// Moves the position past a dead letter the broker has taken (see [`settle`](Self::settle)).
    async fn save_dead_letter_position(&self, position: crate::position::Position) {
        // The dead letter was recorded without moving the position (a crash before the broker
        // confirmed its copy must show the record again). Now the broker has the copy: move the
        // position past it, so a restart does not read a run of dead letters again. Still
        // before the lane's next message, so positions keep their order. A crash between the
        // broker's confirmation and this commit reads the record once more: its dead letter is
        // recorded already (nothing new is written) and the copy is sent again.
        //
        // Forward only: once the broker has the copy, the lane may be someone else's (a Kafka
        // partition moved on), and a late save must not take its position back.
        let saved = with_store(self, || async {
            let mut tx = self.store.begin().await?;
            self.store
                .advance_position(&mut *tx, &self.name, &position)
                .await?;
            self.store.commit(tx).await
        })
        .await;
        if saved.is_none() {
            tracing::debug!("the position after a dead letter was not stored (shutdown); the restart sends its copy again");
        }
    }
}
