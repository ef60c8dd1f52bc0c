//! The suite checks itself: every case passes on the in-memory broker, and fails on a wrapper
//! of it broken in the way that case is about.

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use txinbox::memory::{MemoryDelivery, MemorySource};
use txinbox::{
    async_trait, source::Capabilities, source::Lane, source::SettleError, source::Settlement,
    source::SourceError, Delivery, Message, MessageSource,
};

use super::*;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// A delivery dropped unsettled is acked.
    AckOnDrop,
    /// `Ack` sends nothing (the delivery is dropped, so the broker requeues it).
    IgnoreAck,
    /// `Retry` acks.
    RetryAcks,
    /// `DeadLetter` acks and dead-letters nothing.
    DeadLetterAcks,
    /// A `receive` dropped after taking a message acks it.
    LossyReceive,
    /// A `settle` dropped after its first poll acks, whatever the settlement.
    LossySettle,
    /// `close` never returns.
    HangingClose,
    /// Two deliveries ready at once are handed out in reverse order.
    Reorders,
}

struct Broken {
    inner: MemoryHarness,
    fault: Fault,
}

struct BrokenSource {
    inner: MemorySource,
    fault: Fault,
    held: VecDeque<MemoryDelivery>,
}

struct BrokenDelivery {
    inner: Option<MemoryDelivery>,
    fault: Fault,
}

/// Acks the delivery it holds when dropped.
struct AckOnDrop(Option<MemoryDelivery>);

impl Drop for AckOnDrop {
    fn drop(&mut self) {
        if let Some(d) = self.0.take() {
            tokio::spawn(d.settle(Settlement::Ack));
        }
    }
}

#[async_trait]
impl Harness for Broken {
    type Source = BrokenSource;

    fn features(&self) -> Features {
        self.inner.features().patience(Duration::from_millis(1500))
    }

    async fn publish(&self, message: TestMessage) {
        self.inner.publish(message).await;
    }

    async fn open(&self) -> BrokenSource {
        BrokenSource {
            inner: self.inner.open().await,
            fault: self.fault,
            held: VecDeque::new(),
        }
    }

    async fn dead_letters(&self, expected: usize, within: Duration) -> Option<Vec<Message>> {
        self.inner.dead_letters(expected, within).await
    }
}

#[async_trait]
impl MessageSource for BrokenSource {
    type Delivery = BrokenDelivery;

    async fn receive(&mut self) -> Result<Option<BrokenDelivery>, SourceError> {
        let fault = self.fault;
        let wrap = |d| {
            Ok(Some(BrokenDelivery {
                inner: Some(d),
                fault,
            }))
        };
        if let Some(d) = self.held.pop_front() {
            return wrap(d);
        }
        let Some(d) = self.inner.receive().await? else {
            return Ok(None);
        };
        match fault {
            Fault::LossyReceive => {
                let guard = AckOnDrop(Some(d));
                tokio::task::yield_now().await;
                let mut guard = guard;
                wrap(guard.0.take().unwrap())
            }
            Fault::Reorders => {
                // Everything ready now, handed out last first.
                let mut ready = vec![d];
                while let Ok(Ok(Some(next))) =
                    tokio::time::timeout(Duration::from_millis(20), self.inner.receive()).await
                {
                    ready.push(next);
                }
                let last = ready.pop().unwrap();
                self.held.extend(ready.into_iter().rev());
                wrap(last)
            }
            _ => wrap(d),
        }
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn close(self) -> Result<(), SourceError> {
        if self.fault == Fault::HangingClose {
            std::future::pending::<()>().await;
        }
        self.inner.close().await
    }
}

#[async_trait]
impl Delivery for BrokenDelivery {
    fn message(&self) -> &Message {
        self.inner.as_ref().unwrap().message()
    }

    fn lane(&self) -> Lane {
        self.inner.as_ref().unwrap().lane()
    }

    fn position_to_store(&self) -> Option<txinbox::position::Position> {
        self.inner.as_ref().unwrap().position_to_store()
    }

    async fn settle(mut self, settlement: Settlement) -> Result<(), SettleError> {
        let d = self.inner.take().unwrap();
        match (self.fault, settlement) {
            (Fault::IgnoreAck, Settlement::Ack) => {
                drop(d);
                Ok(())
            }
            (Fault::RetryAcks, Settlement::Retry { .. })
            | (Fault::DeadLetterAcks, Settlement::DeadLetter(_)) => d.settle(Settlement::Ack).await,
            (Fault::LossySettle, s) => {
                let mut guard = AckOnDrop(Some(d));
                tokio::task::yield_now().await;
                guard.0.take().unwrap().settle(s).await
            }
            (_, s) => d.settle(s).await,
        }
    }
}

impl Drop for BrokenDelivery {
    fn drop(&mut self) {
        if self.fault == Fault::AckOnDrop {
            drop(AckOnDrop(self.inner.take()));
        }
    }
}

async fn broken(fault: Fault, case: &'static str) -> Broken {
    Broken {
        inner: MemoryHarness::new(case).await,
        fault,
    }
}

/// Runs `case` on a harness with `fault` and asserts that it fails.
async fn fails<F, Fut>(fault: Fault, case: F)
where
    F: FnOnce(Broken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let run = tokio::spawn(case(broken(fault, "broken").await));
    let result = run.await;
    assert!(
        result.as_ref().is_err_and(|e| e.is_panic()),
        "the case passed on a source broken with {fault:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_case_passes_on_the_memory_broker() {
    run_all(MemoryHarness::new).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_is_final_catches_an_ack_that_sends_nothing() {
    fails(Fault::IgnoreAck, ack_is_final).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_catches_a_retry_that_acks() {
    fails(Fault::RetryAcks, retry_redelivers_later).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_catches_a_dead_letter_that_only_acks() {
    fails(Fault::DeadLetterAcks, dead_letter_moves_it_aside).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_delivery_catches_an_ack_on_drop() {
    fails(Fault::AckOnDrop, dropped_delivery_is_redelivered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_catches_a_close_that_hangs_and_an_ack_on_drop() {
    fails(Fault::HangingClose, close_returns_with_a_delivery_in_flight).await;
    fails(Fault::AckOnDrop, close_returns_with_a_delivery_in_flight).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_cancellation_catches_a_receive_that_loses_its_message() {
    fails(Fault::LossyReceive, receive_survives_cancellation).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_cancellation_catches_a_settle_that_acks_when_dropped() {
    fails(Fault::LossySettle, settle_survives_cancellation).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lane_order_catches_a_source_that_reorders() {
    fails(Fault::Reorders, lanes_keep_publish_order).await;
}
