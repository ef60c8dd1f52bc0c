//! Which delivery runs when: per-lane queues, one task at a time per ordered lane, up to
//! `concurrency` for the unordered queue, linger timers, and lanes stopped behind a delivery
//! left unsettled.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use tokio::task::JoinSet;

use super::intake::{InFlight, Slot};
use super::Shared;
use crate::handler::Handler;
use crate::source::Delivery;
use crate::store::InboxStore;

/// How long queued unordered messages wait for a running transaction to end (and take them)
/// before another transaction starts with less than a full batch (see [`Scheduler::pump`]).
const FULL_BATCH_WAIT: Duration = Duration::from_millis(10);

/// A lane's key in the scheduler: `None` is the shared queue of unordered deliveries.
pub(super) type LaneKey = Option<Arc<str>>;

/// A running linger: resolves to its lane and the generation that started it.
type LingerTimer = Pin<Box<dyn Future<Output = (LaneKey, u64)> + Send>>;

/// The per-lane queues and the tasks serving them.
pub(super) struct Scheduler<D> {
    pub(super) lanes: HashMap<LaneKey, LaneQueue<D>>,
    pub(super) task_lanes: HashMap<tokio::task::Id, LaneKey>,
    /// Lanes whose delivery was left unsettled: nothing after it may run (it would overtake
    /// it), so their later deliveries are dropped unsettled too and will be redelivered. With
    /// where it stopped: see [`Scheduler::stays_stopped`].
    pub(super) stopped_lanes: HashMap<Arc<str>, Stop>,
    /// Linger timers: the lane and the generation that started it.
    pub(super) lingering: FuturesUnordered<LingerTimer>,
    pub(super) generation: u64,
}

pub(super) struct LaneQueue<D> {
    pub(super) queue: VecDeque<InFlight<D>>,
    pub(super) running: usize,
    pub(super) linger: Linger,
}

impl<D> Default for LaneQueue<D> {
    fn default() -> Self {
        LaneQueue {
            queue: VecDeque::new(),
            running: 0,
            linger: Linger::Idle,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Linger {
    Idle,
    /// A timer of this generation runs; the lane waits for more deliveries.
    Waiting(u64),
    /// The timer fired: start with what is queued.
    Expired,
}

impl<D: crate::source::Delivery> Scheduler<D> {
    /// Whether `delivery` of stopped lane `key` must be dropped: until the source starts the
    /// lane over ([`Stop::starts_over`]: another assignment of the lane, or a
    /// delivery at or before where it stopped).
    pub(super) fn stays_stopped(&mut self, key: &Arc<str>, delivery: &D) -> bool {
        let Some(stop) = self.stopped_lanes.get(key) else {
            return false;
        };
        let again = stop.starts_over(delivery);
        if again {
            tracing::info!(lane = %key, "a stopped lane is delivered again from before where it stopped; it runs again");
            self.stopped_lanes.remove(key);
        }
        !again
    }

    /// Starts tasks for `key` while it has queued deliveries and room to run: one task at a time
    /// for an ordered lane, up to `concurrency` for the unordered queue. Each task takes up to
    /// [`batch_take`](Shared::batch_take) queued deliveries (`batch_size`, or what a
    /// `batch_max_duration` fits). Forgets a lane that has nothing queued or running.
    pub(super) fn pump<St, H>(
        &mut self,
        key: &LaneKey,
        tasks: &mut JoinSet<LaneEnd>,
        shared: &Arc<Shared<St, H>>,
    ) where
        St: InboxStore,
        H: Handler<St::Db>,
    {
        let Some(lane) = self.lanes.get_mut(key) else {
            return;
        };
        let max_running = if key.is_some() {
            1
        } else {
            shared.concurrency_limit
        };
        while lane.running < max_running && !lane.queue.is_empty() {
            let limit = shared.batch_take();
            // The shared queue starts a second transaction only with a full batch, or after
            // FULL_BATCH_WAIT: a few messages each in several concurrent transactions cost the
            // database (and the CPU it may share with the broker) far more per message than one
            // transaction of dozens, and the running one usually ends and takes them first.
            // Under load the queue fills, so all `concurrency` transactions still run; with slow
            // handlers the wait ends and they run side by side as before. (Full: as much as
            // max_in_flight leaves each transaction slot, if that is less than a batch.)
            let wait = if key.is_none() && lane.running > 0 && lane.queue.len() < limit.min(shared.full_batch)
            {
                Some(shared.batch_linger.max(FULL_BATCH_WAIT))
            } else if lane.queue.len() < limit && !shared.batch_linger.is_zero() {
                Some(shared.batch_linger)
            } else {
                None
            };
            if let Some(wait) = wait {
                match lane.linger {
                    Linger::Idle => {
                        self.generation += 1;
                        let (generation, key) = (self.generation, key.clone());
                        lane.linger = Linger::Waiting(generation);
                        self.lingering.push(Box::pin(async move {
                            tokio::time::sleep(wait).await;
                            (key, generation)
                        }));
                        break;
                    }
                    Linger::Waiting(_) => break,
                    Linger::Expired => {}
                }
            }
            lane.linger = Linger::Idle;
            let n = lane.queue.len().min(limit);
            let batch: Vec<InFlight<D>> = lane.queue.drain(..n).collect();
            lane.running += 1;
            let shared = shared.clone();
            let id = tasks
                .spawn(async move {
                    let (deliveries, _slots): (Vec<D>, Vec<Slot>) =
                        batch.into_iter().map(|i| (i.delivery, i._slot)).unzip();
                    shared.process_batch(deliveries).await
                })
                .id();
            self.task_lanes.insert(id, key.clone());
        }
        if lane.running == 0 && lane.queue.is_empty() {
            self.lanes.remove(key);
        }
    }
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
    /// Its [`Position::next`](crate::position::Position::next), if it has one.
    pub(super) next: Option<i64>,
    /// Its [`Delivery::assignment`].
    pub(super) assignment: Option<u64>,
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
