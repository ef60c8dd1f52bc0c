//! Deliberate breakage, for the crash matrix's proofs that its checks can fail.
//!
//! [`AckOnReceive`] wraps a [`MessageSource`] and acknowledges every delivery the moment it is
//! received, before the runtime has opened its transaction: exactly what invariant 2 forbids
//! ("the broker is told done only after the commit"). The `ledger` example applies it only
//! when built with the `crash-points` feature and started with
//! `TXINBOX_DEMO_SABOTAGE=ack-before-commit`; the chaos harness does that in its sabotaged
//! database-outage run, which must then fail ("acknowledged during the outage", lost events).

use txinbox::{
    async_trait, position::Position, source::Capabilities, source::Lane, source::SettleError,
    source::Settlement, source::SourceError, Delivery, Message, MessageSource,
};

/// The environment variable that turns the sabotage on (value: `ack-before-commit`).
pub const ENV: &str = "TXINBOX_DEMO_SABOTAGE";

/// A source whose deliveries are acknowledged on receipt when `ENV` says so; otherwise it
/// passes everything through untouched.
pub struct AckOnReceive<S> {
    inner: S,
    on: bool,
}

/// `source`, acknowledging on receipt if `TXINBOX_DEMO_SABOTAGE=ack-before-commit`.
pub fn from_env<S>(source: S) -> AckOnReceive<S> {
    let on = std::env::var(ENV).is_ok_and(|v| v == "ack-before-commit");
    if on {
        tracing::warn!(
            "SABOTAGE: every delivery is acknowledged before its transaction (TXINBOX_DEMO_SABOTAGE)"
        );
    }
    AckOnReceive { inner: source, on }
}

impl<S> std::fmt::Debug for AckOnReceive<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AckOnReceive")
            .field("on", &self.on)
            .finish_non_exhaustive()
    }
}

/// A delivery that may already have been acknowledged.
pub struct Early<D> {
    message: Message,
    lane: Lane,
    position: Option<Position>,
    /// `None` once acknowledged on receipt: the runtime's settlement goes nowhere.
    inner: Option<D>,
}

impl<D> std::fmt::Debug for Early<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Early")
            .field("message", &self.message)
            .field("acked_on_receipt", &self.inner.is_none())
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<S: MessageSource> MessageSource for AckOnReceive<S> {
    type Delivery = Early<S::Delivery>;

    async fn receive(&mut self) -> Result<Option<Self::Delivery>, SourceError> {
        let Some(delivery) = self.inner.receive().await? else {
            return Ok(None);
        };
        let (message, lane, position) = (delivery.message().clone(), delivery.lane(), delivery.position());
        let inner = if self.on {
            if let Err(e) = delivery.settle(Settlement::Ack).await {
                tracing::warn!(error = %e, "SABOTAGE: early ack failed");
            }
            None
        } else {
            Some(delivery)
        };
        Ok(Some(Early {
            message,
            lane,
            position,
            inner,
        }))
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn attach_health(&mut self, health: txinbox::health::SourceHealth) {
        self.inner.attach_health(health);
    }

    fn attach_positions(&mut self, positions: txinbox::position::ConsumerPositions) {
        self.inner.attach_positions(positions);
    }

    async fn close(self) -> Result<(), SourceError> {
        self.inner.close().await
    }
}

#[async_trait]
impl<D: Delivery> Delivery for Early<D> {
    fn message(&self) -> &Message {
        &self.message
    }

    fn lane(&self) -> Lane {
        self.lane.clone()
    }

    fn position(&self) -> Option<Position> {
        self.position.clone()
    }

    fn position_to_store(&self) -> Option<Position> {
        match &self.inner {
            // Asked when it is stored: under key ordering the wrapped delivery's answer moves.
            Some(d) => d.position_to_store(),
            None => self.position.clone(),
        }
    }

    fn reported_lane(&self) -> Lane {
        match &self.inner {
            Some(d) => d.reported_lane(),
            None => self.lane.clone(),
        }
    }

    fn assignment(&self) -> Option<u64> {
        self.inner.as_ref().and_then(Delivery::assignment)
    }

    async fn settle(self, settlement: Settlement) -> Result<(), SettleError> {
        match self.inner {
            Some(d) => d.settle(settlement).await,
            None => Ok(()),
        }
    }
}
