//! An in-process broker with at-least-once semantics and fault injection (feature `memory`).
//!
//! [`MemoryBroker`] is the queue; each [`MemoryBroker::source`] is a competing consumer of it.
//! It behaves like a broker that can only promise at-least-once delivery:
//!
//! - a delivery dropped unsettled goes back to the front of the queue, flagged redelivered;
//! - `Retry { after }` puts the message back after the delay;
//! - `DeadLetter` moves it to [`MemoryBroker::dead_letters`];
//! - faults can be switched on: duplicate deliveries and lost acknowledgements (the settlement
//!   fails and the message comes back, as after a crash between commit and ack).
//!
//! Fault decisions come from one seeded generator. With one consumer at concurrency 1 a run
//! replays exactly from its seed; with more, the order of draws follows task timing, so a seed
//! reproduces the fault *rates*, not the exact sequence.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
#[cfg(test)]
use std::time::Duration;
use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::Notify;

use crate::dead_letter::DeadLetter;
use crate::message::{Headers, IdStrategy, Message, Origin};
use crate::source::{
    Capabilities, Delivery, Lane, MessageSource, RetryMode, SettleError, Settlement, SourceError,
};

/// The in-memory queue. Cloning gives another handle to the same queue.
#[derive(Debug, Clone)]
pub struct MemoryBroker {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    destination: Arc<str>,
    state: Mutex<State>,
    changed: Notify,
}

#[derive(Debug)]
struct State {
    ready: VecDeque<Stored>,
    /// Delivered and not settled, or waiting for a delayed retry.
    outstanding: usize,
    closed: bool,
    next_offset: i64,
    retry_mode: RetryMode,
    duplicate_probability: f64,
    lose_ack_probability: f64,
    rng: fastrand::Rng,
    stats: MemoryStats,
    dead_letters: Vec<(Message, DeadLetter)>,
    /// `Some` once [`MemoryBroker::record_acks`] was called: every ack, in order.
    acks: Option<Vec<AckRecord>>,
}

#[derive(Debug, Clone)]
struct Stored {
    message: Message,
    lane: Option<Arc<str>>,
}

/// Counters kept by a [`MemoryBroker`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Messages published.
    pub published: u64,
    /// Deliveries handed to consumers (including duplicates and redeliveries).
    pub delivered: u64,
    /// Extra copies injected by the duplicate-delivery fault.
    pub duplicates_injected: u64,
    /// Acknowledgements received.
    pub acked: u64,
    /// Acknowledgements lost on purpose (the message came back).
    pub acks_lost: u64,
    /// Retries scheduled.
    pub retried: u64,
    /// Messages dead-lettered.
    pub dead_lettered: u64,
    /// Deliveries dropped without settlement (and requeued).
    pub dropped_unsettled: u64,
}

/// One acknowledgement, for tests that check *when* acks happened.
#[derive(Debug, Clone)]
pub struct AckRecord {
    /// The message's native ID.
    pub native_id: Option<String>,
    /// When the ack arrived.
    pub at: Instant,
}

impl MemoryBroker {
    /// An empty queue called `destination`, redelivering retries, with no faults and a random
    /// seed.
    pub fn new(destination: &str) -> Self {
        Self::with_seed(destination, fastrand::u64(..))
    }

    /// Like [`new`](Self::new), with a fixed seed for the fault injection.
    pub fn with_seed(destination: &str, seed: u64) -> Self {
        MemoryBroker {
            inner: Arc::new(Inner {
                destination: destination.into(),
                state: Mutex::new(State {
                    ready: VecDeque::new(),
                    outstanding: 0,
                    closed: false,
                    next_offset: 0,
                    retry_mode: RetryMode::Redeliver,
                    duplicate_probability: 0.0,
                    lose_ack_probability: 0.0,
                    rng: fastrand::Rng::with_seed(seed),
                    stats: MemoryStats::default(),
                    dead_letters: Vec::new(),
                    acks: None,
                }),
                changed: Notify::new(),
            }),
        }
    }

    /// How sources of this broker ask to be retried: [`RetryMode::Redeliver`] (default, like
    /// AMQP) or [`RetryMode::InPlace`] (like Kafka).
    pub fn set_retry_mode(&self, mode: RetryMode) {
        self.lock().retry_mode = mode;
    }

    /// Each delivery is also left in the queue, to be delivered again, with probability `p`.
    pub fn set_duplicate_probability(&self, p: f64) {
        self.lock().duplicate_probability = p;
    }

    /// Each `Ack` is lost with probability `p`: `settle` fails and the message is redelivered, as
    /// when a consumer crashes between its database commit and its acknowledgement.
    pub fn set_lose_ack_probability(&self, p: f64) {
        self.lock().lose_ack_probability = p;
    }

    /// Publishes a message whose [native ID](Message::native_id) is `id`, in no lane.
    pub fn publish(&self, id: impl Into<String>, payload: impl Into<Bytes>) {
        self.publish_with(None, Some(id.into()), Headers::new(), payload.into());
    }

    /// Publishes a message in ordering lane `lane`.
    pub fn publish_in_lane(&self, lane: &str, id: impl Into<String>, payload: impl Into<Bytes>) {
        self.publish_with(Some(lane), Some(id.into()), Headers::new(), payload.into());
    }

    /// Publishes with full control: lane, native ID (none if `None`), headers and payload.
    pub fn publish_with(&self, lane: Option<&str>, id: Option<String>, headers: Headers, payload: Bytes) {
        let mut s = self.lock();
        let offset = s.next_offset;
        s.next_offset += 1;
        let mut message = Message::new(
            payload,
            Origin {
                system: "memory",
                destination: self.inner.destination.clone(),
                partition: None,
                offset: Some(offset),
            },
        )
        .with_headers(headers);
        if let Some(id) = id {
            message = message.with_native_id(id);
        }
        s.ready.push_back(Stored {
            message,
            lane: lane.map(Arc::from),
        });
        s.stats.published += 1;
        drop(s);
        self.inner.changed.notify_waiters();
    }

    /// After this, sources return `Ok(None)` once nothing is queued or outstanding.
    pub fn close(&self) {
        self.lock().closed = true;
        self.inner.changed.notify_waiters();
    }

    /// A competing consumer of this queue.
    pub fn source(&self) -> MemorySource {
        MemorySource {
            inner: self.inner.clone(),
        }
    }

    /// The counters.
    pub fn stats(&self) -> MemoryStats {
        self.lock().stats.clone()
    }

    /// Dead-lettered messages and why.
    pub fn dead_letters(&self) -> Vec<(Message, DeadLetter)> {
        self.lock().dead_letters.clone()
    }

    /// Starts keeping a record of every acknowledgement (off by default: the record grows
    /// with every message).
    pub fn record_acks(&self) {
        self.lock().acks.get_or_insert_with(Vec::new);
    }

    /// Every acknowledgement since [`record_acks`](Self::record_acks), in order.
    pub fn acks(&self) -> Vec<AckRecord> {
        self.lock().acks.clone().unwrap_or_default()
    }

    /// Messages queued plus deliveries not yet settled.
    pub fn pending(&self) -> usize {
        let s = self.lock();
        s.ready.len() + s.outstanding
    }

    /// Waits until nothing is queued or outstanding.
    pub async fn wait_idle(&self) {
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.pending() == 0 {
                return;
            }
            changed.await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.lock()
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock would be a bug in this module; the state is still
        // consistent enough for a test double, so keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Puts a message back (`front`: ahead of everything, as a broker requeue does).
    fn requeue(&self, mut stored: Stored, front: bool) {
        stored.message = stored.message.with_redelivered(true);
        let mut s = self.lock();
        s.outstanding -= 1;
        if front {
            s.ready.push_front(stored);
        } else {
            s.ready.push_back(stored);
        }
        drop(s);
        self.changed.notify_waiters();
    }
}

/// A consumer of a [`MemoryBroker`].
#[derive(Debug)]
pub struct MemorySource {
    inner: Arc<Inner>,
}

impl MemorySource {
    /// The next ready message as a delivery, `Some(None)` if the broker is closed and drained,
    /// `None` if the caller must wait.
    fn take(&self) -> Option<Option<MemoryDelivery>> {
        let mut s = self.inner.lock();
        if let Some(stored) = s.ready.pop_front() {
            s.outstanding += 1;
            s.stats.delivered += 1;
            let p = s.duplicate_probability;
            if p > 0.0 && s.rng.f64() < p {
                s.ready.push_back(stored.clone());
                s.stats.duplicates_injected += 1;
            }
            return Some(Some(MemoryDelivery {
                inner: self.inner.clone(),
                stored: Some(stored),
            }));
        }
        (s.closed && s.outstanding == 0).then_some(None)
    }
}

#[async_trait]
impl MessageSource for MemorySource {
    type Delivery = MemoryDelivery;

    /// Cancellation safe: a message leaves the queue only in the same synchronous step that
    /// returns it.
    async fn receive(&mut self) -> Result<Option<MemoryDelivery>, SourceError> {
        // NOTE: what is ready is taken without registering a waiter (under load, always); only
        // an empty queue registers one, then looks again, so a publish in between is not missed.
        if let Some(ready) = self.take() {
            return Ok(ready);
        }
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(ready) = self.take() {
                return Ok(ready);
            }
            changed.await;
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            system: "memory",
            retry: self.inner.lock().retry_mode,
            default_id_strategy: IdStrategy::Native,
        }
    }

    async fn close(self) -> Result<(), SourceError> {
        Ok(())
    }
}

/// One delivery from a [`MemoryBroker`]. Dropped unsettled, it is requeued at the front.
#[derive(Debug)]
pub struct MemoryDelivery {
    inner: Arc<Inner>,
    stored: Option<Stored>,
}

impl MemoryDelivery {
    fn stored(&self) -> &Stored {
        self.stored.as_ref().expect("present until settled or dropped")
    }
}

#[async_trait]
impl Delivery for MemoryDelivery {
    fn message(&self) -> &Message {
        &self.stored().message
    }

    fn lane(&self) -> Lane {
        match &self.stored().lane {
            Some(l) => Lane::Ordered(l.clone()),
            None => Lane::Unordered,
        }
    }

    fn position_to_store(&self) -> Option<crate::position::Position> {
        None // the in-memory broker has no positions
    }

    async fn settle(mut self, settlement: Settlement) -> Result<(), SettleError> {
        let stored = self.stored.take().expect("settled once");
        let inner = self.inner.clone();
        match settlement {
            Settlement::Ack => {
                let mut s = inner.lock();
                let p = s.lose_ack_probability;
                if p > 0.0 && s.rng.f64() < p {
                    s.stats.acks_lost += 1;
                    drop(s);
                    inner.requeue(stored, false);
                    return Err(SettleError::new("acknowledgement lost (injected fault)"));
                }
                s.outstanding -= 1;
                s.stats.acked += 1;
                if let Some(acks) = &mut s.acks {
                    acks.push(AckRecord {
                        native_id: stored.message.native_id().map(str::to_owned),
                        at: Instant::now(),
                    });
                }
            }
            Settlement::Retry { after } => {
                inner.lock().stats.retried += 1;
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    inner.requeue(stored, false);
                });
                return Ok(());
            }
            Settlement::DeadLetter(dl) => {
                let mut s = inner.lock();
                s.outstanding -= 1;
                s.stats.dead_lettered += 1;
                s.dead_letters.push((stored.message, dl));
            }
        }
        inner.changed.notify_waiters();
        Ok(())
    }
}

impl Drop for MemoryDelivery {
    fn drop(&mut self) {
        if let Some(stored) = self.stored.take() {
            self.inner.lock().stats.dropped_unsettled += 1;
            self.inner.requeue(stored, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn millis(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[tokio::test]
    async fn unsettled_deliveries_come_back_and_close_waits_for_them() {
        let broker = MemoryBroker::with_seed("q", 1);
        broker.publish("a", "1");
        broker.publish("b", "2");
        broker.close();
        let mut src = broker.source();
        let a = src.receive().await.unwrap().unwrap();
        assert_eq!(a.message().native_id(), Some("a"));
        drop(a); // crash before settling
        let again = src.receive().await.unwrap().unwrap();
        assert_eq!(again.message().native_id(), Some("a"));
        assert!(again.message().redelivered());
        again.settle(Settlement::Ack).await.unwrap();
        let b = src.receive().await.unwrap().unwrap();
        b.settle(Settlement::Retry { after: millis(20) }).await.unwrap();
        let started = Instant::now();
        let b = src.receive().await.unwrap().unwrap();
        assert!(started.elapsed() >= millis(15), "retry honoured its delay");
        b.settle(Settlement::Ack).await.unwrap();
        assert!(src.receive().await.unwrap().is_none());
        let stats = broker.stats();
        assert_eq!((stats.acked, stats.dropped_unsettled, stats.retried), (2, 1, 1));
    }

    #[tokio::test]
    async fn lost_acks_fail_the_settlement_and_redeliver() {
        let broker = MemoryBroker::with_seed("q", 7);
        broker.set_lose_ack_probability(1.0);
        broker.publish("a", "1");
        let mut src = broker.source();
        let d = src.receive().await.unwrap().unwrap();
        assert!(d.settle(Settlement::Ack).await.is_err());
        assert_eq!(broker.pending(), 1);
        assert_eq!(broker.stats().acks_lost, 1);
    }
}
