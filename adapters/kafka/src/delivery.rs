//! [`KafkaDelivery`]: one record handed to the runtime, the position it stores with its
//! effects, and what settling or dropping it does to its partition's offsets.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use txinbox::{position::Position, source::Lane, source::SettleError, source::Settlement, Delivery, Message};

use crate::state::Shared;
use crate::tracker::Generation;

/// One Kafka record and the right to settle it.
pub struct KafkaDelivery {
    pub(crate) message: Message,
    /// The partition's lane, `topic/partition`.
    pub(crate) lane: Arc<str>,
    /// The ordering lane: the partition's, the record key's, or none.
    pub(crate) order: Lane,
    pub(crate) topic: Arc<str>,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    pub(crate) timestamp: Option<i64>,
    pub(crate) generation: Arc<Generation>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) settled: bool,
}

impl fmt::Debug for KafkaDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaDelivery")
            .field("topic", &self.topic)
            .field("partition", &self.partition)
            .field("offset", &self.offset)
            .finish_non_exhaustive()
    }
}

impl KafkaDelivery {
    /// The record's topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The record's partition.
    pub fn partition(&self) -> i32 {
        self.partition
    }

    /// The record's offset.
    pub fn offset(&self) -> i64 {
        self.offset
    }

    /// The record's timestamp in milliseconds since the epoch, if it has one.
    pub fn timestamp(&self) -> Option<i64> {
        self.timestamp
    }

    fn not_assigned(&self) -> SettleError {
        SettleError::new(format!(
            "partition {}/{} is no longer assigned to this member; offset {} is not stored (the new owner redelivers it and the inbox deduplicates)",
            self.topic, self.partition, self.offset
        ))
    }
}

#[async_trait]
impl Delivery for KafkaDelivery {
    fn message(&self) -> &Message {
        &self.message
    }

    fn lane(&self) -> Lane {
        self.order.clone()
    }

    fn reported_lane(&self) -> Lane {
        Lane::Ordered(self.lane.clone())
    }

    fn assignment(&self) -> Option<u64> {
        Some(self.generation.epoch)
    }

    fn position(&self) -> Option<Position> {
        // An earlier offset of this partition was dropped unsettled (shutdown during an in-place
        // retry): storing this one's position would make a restart skip it. Leave the database
        // position where it is; the restart redelivers from there and the inbox deduplicates.
        // (Under key and unordered ordering what is stored comes from the tracker, whose prefix
        // stops at the hole; this one is the record's own place, whatever its neighbours did.)
        if self.shared.config.ordering == crate::Ordering::Partition
            && self.generation.has_hole_below(self.offset)
        {
            return None;
        }
        Some(Position {
            source: self.topic.clone(),
            lane: self.partition.to_string().into(),
            next: self.offset + 1,
        })
    }

    fn position_to_store(&self) -> Option<Position> {
        if self.shared.config.ordering == crate::Ordering::Partition {
            // One lane per partition: everything before this record is settled (or its
            // lane stopped, and then `position` says so).
            return self.position();
        }
        // Records of the partition settle out of order: the contiguous settled prefix, this
        // record counted as settled, unless another transaction was handed as much already.
        // Nothing if the partition is no longer this assignment's.
        let next = {
            let mut state = self.shared.lock();
            match state.get_mut(&self.topic, self.partition) {
                Some(p) if p.epoch() == self.generation.epoch => p.prefix_to_store(self.offset)?,
                _ => return None,
            }
        };
        Some(Position {
            source: self.topic.clone(),
            lane: self.partition.to_string().into(),
            next,
        })
    }

    async fn settle(mut self, settlement: Settlement) -> Result<(), SettleError> {
        match settlement {
            Settlement::Ack => {}
            Settlement::DeadLetter(dl) => self.produce_dead_letter(&dl).await?,
            Settlement::Retry { .. } => {
                return Err(SettleError::new(
                    "Kafka cannot redeliver one record later (the source's RetryMode is InPlace); the offset is not stored",
                ));
            }
        }
        let mut state = self.shared.lock();
        match state.get_mut(&self.topic, self.partition) {
            Some(p) if p.epoch() == self.generation.epoch => {
                p.settle(self.offset);
                self.settled = true;
                drop(state);
                self.shared.settled.notify_all();
                Ok(())
            }
            _ => {
                // Nothing to track any more: not an abandonment of the current assignment.
                self.settled = true;
                Err(self.not_assigned())
            }
        }
    }
}

impl Drop for KafkaDelivery {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        {
            let mut state = self.shared.lock();
            match state.get_mut(&self.topic, self.partition) {
                Some(p) if p.epoch() == self.generation.epoch => p.abandon(self.offset),
                // Revoked already: no tracker, but the later deliveries of this assignment
                // still in the runtime must not report positions past this one.
                _ => self.generation.abandon(self.offset),
            }
        }
        self.shared.settled.notify_all();
    }
}
