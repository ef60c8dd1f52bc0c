//! Metric names. Everything goes through the `metrics` facade; txinbox never installs a
//! recorder or exporter, and never a tracing subscriber. Every metric carries a `consumer` label.
//!
//! | metric | kind | meaning |
//! |---|---|---|
//! | `txinbox_processed_total` | counter | handler ran and its transaction committed |
//! | `txinbox_duplicates_total` | counter | ID already in the inbox with the same fingerprint: acked, handler not run |
//! | `txinbox_conflicts_total` | counter | ID already in the inbox with another fingerprint: dead-lettered |
//! | `txinbox_retries_total` | counter | transient failure, attempt counted, retry scheduled |
//! | `txinbox_contention_retries_total` | counter | a transaction lost a lock conflict (deadlock, serialization failure, lock timeout) and is re-run without counting an attempt |
//! | `txinbox_dead_letters_total` | counter | dead-letter settlements; label `reason` (a redelivered dead letter, sent to the broker again, counts again) |
//! | `txinbox_ack_failures_total` | counter | the settlement after a finished transaction did not reach the broker (redelivery will be a duplicate) |
//! | `txinbox_store_errors_total` | counter | the inbox database was unavailable; intake pauses |
//! | `txinbox_handler_duration_seconds` | histogram | time in one handler call (a `BatchHandler` call: its whole batch) |
//! | `txinbox_commit_duration_seconds` | histogram | time in COMMIT (one per transaction; a batch shares one) |
//! | `txinbox_in_flight` | gauge | deliveries received and not yet settled |
//! | `txinbox_lane_oldest_unsettled_age_seconds` | gauge | age of the oldest delivery received and not yet settled, per lane (label `lane`: `topic/partition` for Kafka, empty for unordered deliveries); 0 when none; refreshed every 5 s while the consumer runs |
//! | `txinbox_contended` | gauge | messages re-running because they keep losing lock conflicts (a row locked elsewhere holds their lane) |
//! | `txinbox_outbox_pending` | gauge | outbox rows waiting to be published (label `relay`, refreshed by the relay) |
//! | `txinbox_outbox_oldest_pending_age_seconds` | gauge | age of the oldest pending outbox row, 0 when none (label `relay`) |
//! | `txinbox_outbox_published_total` | counter | outbox rows published and marked (label `relay`) |
//! | `txinbox_outbox_publish_failures_total` | counter | publish attempts the broker did not confirm (label `relay`) |
//! | `txinbox_outbox_dead_letters_total` | counter | outbox rows dead-lettered after bounded attempts or a permanent error (label `relay`) |
//! | `txinbox_retention_deleted_total` | counter | rows deleted by a retention [janitor](crate::janitor) (label `table`: `inbox`, `outbox`, `http_idempotency`; with `consumer` or `relay`) |
//! | `txinbox_retention_oldest_row_age_seconds` | gauge | age of the oldest row retention looks at, read after each pass, 0 when none (same labels) |
//! | `txinbox_retention_batch_duration_seconds` | histogram | time one retention `DELETE` took (same labels) |
//!
//! A consumer takes its metric handles from the recorder installed when it is **built**
//! ([`ConsumerBuilder::build`](crate::ConsumerBuilder::build)), so the per-message path only
//! increments: install your recorder before building consumers.

use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram};

use crate::dead_letter::DeadLetterReason;

/// Counter: messages whose effects committed.
pub const PROCESSED: &str = "txinbox_processed_total";
/// Counter: duplicates acknowledged without running the handler.
pub const DUPLICATES: &str = "txinbox_duplicates_total";
/// Counter: same ID, different payload.
pub const CONFLICTS: &str = "txinbox_conflicts_total";
/// Counter: retries scheduled after a transient failure.
pub const RETRIES: &str = "txinbox_retries_total";
/// Counter: transactions re-run after losing a lock conflict, no attempt counted.
pub const CONTENTION_RETRIES: &str = "txinbox_contention_retries_total";
/// Counter: dead letters, by `reason`.
pub const DEAD_LETTERS: &str = "txinbox_dead_letters_total";
/// Counter: settlements after commit that did not reach the broker.
pub const ACK_FAILURES: &str = "txinbox_ack_failures_total";
/// Counter: inbox database unavailable.
pub const STORE_ERRORS: &str = "txinbox_store_errors_total";
/// Histogram: handler time in seconds.
pub const HANDLER_DURATION: &str = "txinbox_handler_duration_seconds";
/// Histogram: COMMIT time in seconds.
pub const COMMIT_DURATION: &str = "txinbox_commit_duration_seconds";
/// Gauge: deliveries in flight.
pub const IN_FLIGHT: &str = "txinbox_in_flight";
/// Gauge: age in seconds of the oldest unsettled delivery, per `lane`.
pub const LANE_OLDEST_UNSETTLED_AGE: &str = "txinbox_lane_oldest_unsettled_age_seconds";
/// Gauge: messages re-running after lock conflicts.
pub const CONTENDED: &str = "txinbox_contended";
/// Gauge: outbox rows waiting to be published.
pub const OUTBOX_PENDING: &str = "txinbox_outbox_pending";
/// Gauge: age in seconds of the oldest pending outbox row.
pub const OUTBOX_OLDEST_PENDING_AGE: &str = "txinbox_outbox_oldest_pending_age_seconds";
/// Counter: outbox rows published and marked.
pub const OUTBOX_PUBLISHED: &str = "txinbox_outbox_published_total";
/// Counter: outbox publish attempts not confirmed by the broker.
pub const OUTBOX_PUBLISH_FAILURES: &str = "txinbox_outbox_publish_failures_total";
/// Counter: outbox rows dead-lettered.
pub const OUTBOX_DEAD_LETTERS: &str = "txinbox_outbox_dead_letters_total";
/// Counter: rows deleted by a retention janitor, by `table`.
pub const RETENTION_DELETED: &str = "txinbox_retention_deleted_total";
/// Gauge: age in seconds of the oldest row a retention janitor looks at, by `table`.
pub const RETENTION_OLDEST_ROW_AGE: &str = "txinbox_retention_oldest_row_age_seconds";
/// Histogram: time in seconds of one retention `DELETE`, by `table`.
pub const RETENTION_BATCH_DURATION: &str = "txinbox_retention_batch_duration_seconds";
/// Counter: retention passes that failed (and are tried again after the interval), by `table`.
pub const RETENTION_FAILED_PASSES: &str = "txinbox_retention_failed_passes_total";

/// One consumer's metric handles, resolved once when it is built: the per-message path only
/// increments them (no label allocation, no registry lookup).
pub(crate) struct Metrics {
    consumer: Arc<str>,
    pub(crate) processed: Counter,
    pub(crate) duplicates: Counter,
    pub(crate) conflicts: Counter,
    pub(crate) retries: Counter,
    pub(crate) contention_retries: Counter,
    pub(crate) ack_failures: Counter,
    pub(crate) store_errors: Counter,
    pub(crate) handler_duration: Histogram,
    pub(crate) commit_duration: Histogram,
    pub(crate) in_flight: Gauge,
    pub(crate) contended: Gauge,
}

impl Metrics {
    pub(crate) fn new(consumer: &Arc<str>) -> Self {
        describe();
        let label = || [("consumer", consumer.to_string())];
        Metrics {
            consumer: consumer.clone(),
            processed: metrics::counter!(PROCESSED, &label()),
            duplicates: metrics::counter!(DUPLICATES, &label()),
            conflicts: metrics::counter!(CONFLICTS, &label()),
            retries: metrics::counter!(RETRIES, &label()),
            contention_retries: metrics::counter!(CONTENTION_RETRIES, &label()),
            ack_failures: metrics::counter!(ACK_FAILURES, &label()),
            store_errors: metrics::counter!(STORE_ERRORS, &label()),
            handler_duration: metrics::histogram!(HANDLER_DURATION, &label()),
            commit_duration: metrics::histogram!(COMMIT_DURATION, &label()),
            in_flight: metrics::gauge!(IN_FLIGHT, &label()),
            contended: metrics::gauge!(CONTENDED, &label()),
        }
    }

    /// Dead letters are rare and labelled by reason, so their handle is looked up each time.
    pub(crate) fn dead_letter(&self, reason: DeadLetterReason) {
        metrics::counter!(DEAD_LETTERS, "consumer" => self.consumer.to_string(), "reason" => reason.as_str())
            .increment(1);
    }
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        PROCESSED,
        "Messages whose handler ran and whose transaction committed"
    );
    describe_counter!(
        DUPLICATES,
        "Duplicate deliveries acknowledged without running the handler"
    );
    describe_counter!(
        CONFLICTS,
        "Deliveries whose ID was seen with a different payload fingerprint"
    );
    describe_counter!(RETRIES, "Transient failures scheduled for another attempt");
    describe_counter!(
        CONTENTION_RETRIES,
        "Transactions re-run after losing a lock conflict, without counting an attempt"
    );
    describe_counter!(DEAD_LETTERS, "Messages dead-lettered, by reason");
    describe_counter!(
        ACK_FAILURES,
        "Settlements after commit that did not reach the broker"
    );
    describe_counter!(STORE_ERRORS, "Inbox database unavailable; intake paused");
    describe_histogram!(HANDLER_DURATION, Unit::Seconds, "Time spent in the handler");
    describe_histogram!(COMMIT_DURATION, Unit::Seconds, "Time spent in COMMIT");
    describe_gauge!(IN_FLIGHT, "Deliveries received and not yet settled");
    describe_gauge!(
        LANE_OLDEST_UNSETTLED_AGE,
        Unit::Seconds,
        "Age of the oldest delivery received and not yet settled, per lane"
    );
    describe_gauge!(
        CONTENDED,
        "Messages re-running because they keep losing lock conflicts"
    );
}

/// Describes the retention metrics ([`crate::janitor`]).
pub(crate) fn describe_retention() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(RETENTION_DELETED, "Rows deleted by retention");
    describe_counter!(
        RETENTION_FAILED_PASSES,
        "Retention passes that failed and are tried again after the interval"
    );
    describe_gauge!(
        RETENTION_OLDEST_ROW_AGE,
        Unit::Seconds,
        "Age of the oldest row retention looks at"
    );
    describe_histogram!(
        RETENTION_BATCH_DURATION,
        Unit::Seconds,
        "Time one retention DELETE took"
    );
}
