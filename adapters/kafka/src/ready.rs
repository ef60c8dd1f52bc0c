//! [`Ready`]: messages the poller handed over and [`KafkaSource::receive`] has not handed out
//! yet, one queue per partition, handed out in turn.
//!
//! librdkafka delivers a fetch partition by partition: thousands of one partition's messages,
//! then the next's. Handed out in that order, one partition's backlog can take every in-flight
//! slot the consumer has, and since a partition's lane runs one transaction at a time the other
//! lanes wait with nothing to do. Taking the partitions in turn keeps every lane supplied.
//!
//! [`KafkaSource::receive`]: crate::KafkaSource

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Per-partition FIFO queues served round robin: one item from each partition that has any,
/// in the order they first had one. Keyed by the partition's lane (`topic/partition`).
#[derive(Debug)]
pub(crate) struct Ready<T> {
    queues: HashMap<Arc<str>, VecDeque<T>>,
    /// The partitions with something queued, in the order they are served.
    turn: VecDeque<Arc<str>>,
}

impl<T> Default for Ready<T> {
    fn default() -> Self {
        Ready {
            queues: HashMap::new(),
            turn: VecDeque::new(),
        }
    }
}

impl<T> Ready<T> {
    /// Queues `item` behind its partition's earlier ones.
    pub(crate) fn push(&mut self, lane: Arc<str>, item: T) {
        let queue = self.queues.entry(lane.clone()).or_default();
        if queue.is_empty() {
            self.turn.push_back(lane);
        }
        queue.push_back(item);
    }

    /// The oldest item of the partition whose turn it is.
    pub(crate) fn pop(&mut self) -> Option<T> {
        let key = self.turn.pop_front()?;
        let queue = self
            .queues
            .get_mut(&key)
            .expect("a partition in turn has a queue");
        let item = queue.pop_front().expect("a partition in turn has an item");
        if queue.is_empty() {
            self.queues.remove(&key);
        } else {
            self.turn.push_back(key);
        }
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_take_turns_and_each_keeps_its_order() {
        let lane = |l: &str| -> Arc<str> { l.into() };
        let mut ready = Ready::default();
        for i in 0..4 {
            ready.push(lane("a/0"), format!("a0-{i}"));
        }
        ready.push(lane("a/1"), "a1-0".to_string());
        for i in 0..2 {
            ready.push(lane("b/0"), format!("b0-{i}"));
        }
        let order: Vec<String> = std::iter::from_fn(|| ready.pop()).collect();
        assert_eq!(
            order,
            ["a0-0", "a1-0", "b0-0", "a0-1", "b0-1", "a0-2", "a0-3"],
            "one from each partition in turn, each partition in its own order"
        );
        assert!(ready.queues.is_empty() && ready.turn.is_empty());
        ready.push(lane("b/0"), "b0-2".to_string());
        assert_eq!(
            ready.pop().as_deref(),
            Some("b0-2"),
            "a drained partition can come back"
        );
        assert_eq!(ready.pop(), None);
    }
}
