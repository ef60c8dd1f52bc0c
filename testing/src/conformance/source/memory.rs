//! [`MemoryHarness`]: the suite's harness for txinbox's in-memory broker, and the model for a
//! third-party one.

use std::time::{Duration, Instant};

use txinbox::memory::{MemoryBroker, MemorySource};
use txinbox::{async_trait, Message};

use super::{Features, Harness};
use crate::conformance::source::TestMessage;

/// A fresh [`MemoryBroker`] queue per case. txinbox's `tests/source_conformance.rs` is one
/// line: `txinbox_testing::source_conformance!(MemoryHarness::new);`.
#[derive(Debug, Clone)]
pub struct MemoryHarness {
    broker: MemoryBroker,
}

impl MemoryHarness {
    /// A new, empty queue named after the case (a `Future`, to fit the harness constructor
    /// [`source_conformance!`](crate::source_conformance) expects).
    pub fn new(case: &'static str) -> std::future::Ready<MemoryHarness> {
        std::future::ready(MemoryHarness {
            broker: MemoryBroker::new(case),
        })
    }

    /// The broker, for counters and fault injection.
    pub fn broker(&self) -> &MemoryBroker {
        &self.broker
    }
}

#[async_trait]
impl Harness for MemoryHarness {
    type Source = MemorySource;

    fn features(&self) -> Features {
        Features::default()
            .redelivers_while_open(true)
            .patience(Duration::from_secs(5))
            .quiet(Duration::from_millis(100))
    }

    async fn publish(&self, message: TestMessage) {
        self.broker.publish_with(
            message.key.as_deref(),
            Some(message.id),
            message.headers,
            message.payload.into(),
        );
    }

    async fn open(&self) -> MemorySource {
        self.broker.source()
    }

    async fn dead_letters(&self, expected: usize, within: Duration) -> Option<Vec<Message>> {
        let started = Instant::now();
        loop {
            let dead = self.broker.dead_letters();
            if dead.len() >= expected || started.elapsed() >= within {
                return Some(dead.into_iter().map(|(m, _)| m).collect());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
