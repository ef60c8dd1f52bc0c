//! The source wrapper that reports every acknowledged settlement to a [`Probe`].

use std::sync::Arc;

use txinbox::{
    async_trait, position::Position, source::Capabilities, source::Lane, source::SettleError,
    source::Settlement, source::SourceError, Delivery, Message, MessageSource,
};

use crate::measure::{published_at, Probe};

/// A source whose deliveries report their acknowledgement to a [`Probe`].
pub(crate) struct Timed<S> {
    pub(crate) inner: S,
    pub(crate) probe: Arc<Probe>,
}

pub(crate) struct TimedDelivery<D> {
    pub(crate) inner: D,
    pub(crate) probe: Arc<Probe>,
}

#[async_trait]
impl<S: MessageSource> MessageSource for Timed<S> {
    type Delivery = TimedDelivery<S::Delivery>;
    async fn receive(&mut self) -> Result<Option<Self::Delivery>, SourceError> {
        Ok(self.inner.receive().await?.map(|inner| TimedDelivery {
            inner,
            probe: self.probe.clone(),
        }))
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn attach_positions(&mut self, positions: txinbox::position::ConsumerPositions) {
        self.inner.attach_positions(positions);
    }
    async fn close(self) -> Result<(), SourceError> {
        self.inner.close().await
    }
}

#[async_trait]
impl<D: Delivery> Delivery for TimedDelivery<D> {
    fn message(&self) -> &Message {
        self.inner.message()
    }
    fn lane(&self) -> Lane {
        self.inner.lane()
    }
    fn position(&self) -> Option<Position> {
        self.inner.position()
    }
    fn position_to_store(&self) -> Option<Position> {
        self.inner.position_to_store()
    }
    fn reported_lane(&self) -> Lane {
        self.inner.reported_lane()
    }
    fn assignment(&self) -> Option<u64> {
        self.inner.assignment()
    }
    async fn settle(self, settlement: Settlement) -> Result<(), SettleError> {
        let ack = settlement == Settlement::Ack;
        let sent = published_at(self.inner.message());
        let result = self.inner.settle(settlement).await;
        if ack && result.is_ok() {
            self.probe.record(sent);
        }
        result
    }
}
