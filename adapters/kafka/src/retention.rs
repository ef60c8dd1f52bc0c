//! A database position behind the broker's retention: records between the position and the
//! partition's low watermark were deleted before the consumer processed them (a database
//! restored from an old backup, a consumer stopped longer than the topic's retention).
//!
//! Seeking to such a position is answered by librdkafka's `auto.offset.reset`, which skips
//! everything retained (`latest`) or the deleted range (`earliest`) without a word. So every
//! partition that starts from a database position is compared with the low watermark first
//! ([`check`]): a gap is logged at ERROR and counted, and [`KafkaConfig::on_retention_gap`]
//! decides whether the partition is held or starts at the earliest retained offset.
//!
//! [`KafkaConfig::on_retention_gap`]: crate::KafkaConfig::on_retention_gap

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer as _};

use crate::config::RetentionGap;
use crate::poller::PollerContext;
use crate::state::Shared;
use crate::telemetry;
use crate::tracker::Hold;

/// Where a partition whose database position was checked against the low watermark starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// At its database position: nothing after it was deleted.
    Position,
    /// Nowhere yet: held, for a gap ([`RetentionGap::Refuse`]) or because the low watermark
    /// could not be read (fail closed; checked again later).
    Hold(Hold),
    /// At the earliest retained offset: the gap accepted ([`RetentionGap::Earliest`]).
    Earliest,
}

/// Compares `position`, the database position of `topic`/`partition`, with the broker's low
/// watermark (one request, at most `timeout`, on the poller thread). A gap is never passed over
/// silently: an ERROR names the partition, the position, the low watermark and how many offsets
/// were deleted unprocessed, and [`telemetry::OFFSETS_DELETED_UNPROCESSED`] counts them.
pub(crate) fn check(
    consumer: &BaseConsumer<PollerContext>,
    shared: &Shared,
    topic: &str,
    partition: i32,
    position: i64,
    timeout: Duration,
) -> Start {
    let low = match consumer.fetch_watermarks(topic, partition, timeout) {
        Ok((low, _high)) => low,
        Err(error) => {
            tracing::warn!(
                %topic,
                partition,
                position,
                %error,
                "the low watermark could not be read, so the database position cannot be checked against the broker's retention: the partition is held and checked again"
            );
            return Start::Hold(Hold::BehindRetention { position, low: None });
        }
    };
    let Some(deleted) = deleted_unprocessed(position, low) else {
        return Start::Position;
    };
    let consumer_name = shared.consumer_name();
    metrics::counter!(
        telemetry::OFFSETS_DELETED_UNPROCESSED,
        "consumer" => consumer_name.to_owned(),
        "topic" => topic.to_owned(),
        "partition" => partition.to_string()
    )
    .increment(deleted);
    let policy = shared.config.on_retention_gap;
    match policy {
        RetentionGap::Earliest => {
            tracing::error!(
                %topic,
                partition,
                consumer = %consumer_name,
                position,
                low_watermark = low,
                deleted_unprocessed = deleted,
                "{topic}/{partition}: the database position {position} is behind the broker's low watermark {low}: retention deleted {deleted} records (offsets {position}..{low}) this consumer never processed, and their effects are lost. Consuming from the earliest retained offset, as configured (on_retention_gap = earliest)"
            );
            Start::Earliest
        }
        _ => {
            tracing::error!(
                %topic,
                partition,
                consumer = %consumer_name,
                position,
                low_watermark = low,
                deleted_unprocessed = deleted,
                "NOT consuming {topic}/{partition}: the database position {position} is behind the broker's low watermark {low}: retention deleted {deleted} records (offsets {position}..{low}) this consumer never processed (a database restored from an old backup, or the consumer stopped longer than the topic's retention?). Their effects are missing. To go on without them, accept the gap: `txinbox positions set --to-earliest` (picked up within seconds, without a restart) or KafkaConfig::on_retention_gap(RetentionGap::Earliest)"
            );
            Start::Hold(Hold::BehindRetention {
                position,
                low: Some(low),
            })
        }
    }
}

/// How many offsets before the low watermark `low` a partition at `position` never read:
/// `None` when nothing was deleted unread.
fn deleted_unprocessed(position: i64, low: i64) -> Option<u64> {
    (position < low).then(|| (low - position) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_position_below_the_low_watermark_is_a_gap() {
        assert_eq!(deleted_unprocessed(10, 10), None, "at the low watermark");
        assert_eq!(deleted_unprocessed(12, 10), None, "after it");
        assert_eq!(deleted_unprocessed(3, 10), Some(7));
        assert_eq!(deleted_unprocessed(0, 1), Some(1));
    }
}
