//! The contract between the runtime and a broker adapter.
//!
//! An adapter implements [`MessageSource`] (pull the next delivery) and [`Delivery`] (one message
//! plus the means to settle it). The runtime decides *how* each delivery ends; the adapter only
//! knows how to carry that out on its broker.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::dead_letter::DeadLetter;
use crate::message::{IdStrategy, Message};
use crate::position::{ConsumerPositions, Position};

/// A stream of deliveries from one broker subscription (a Kafka consumer, an AMQP queue
/// consumer, an in-memory queue).
///
/// # Contract
///
/// - [`receive`](MessageSource::receive) is **cancellation safe**: if its future is dropped
///   before it completes, no delivery is lost; it will be returned by a later call. The runtime
///   drops it on shutdown.
/// - Deliveries are independent of the source once returned: they are settled from other tasks,
///   concurrently with further `receive` calls, and may outlive the `&mut self` borrow.
/// - A source never acknowledges anything by itself. Only [`Delivery::settle`] does.
#[async_trait]
pub trait MessageSource: Send + 'static {
    /// One received message and its settlement handle.
    type Delivery: Delivery;

    /// Waits for the next delivery. `Ok(None)` means the source is finished (closed or
    /// drained) and the consumer should shut down.
    ///
    /// Errors marked [transient](SourceError::is_transient) make the runtime back off and call
    /// again; any other error stops the consumer.
    async fn receive(&mut self) -> Result<Option<Self::Delivery>, SourceError>;

    /// What the broker can do natively. Read once, when the consumer is built.
    fn capabilities(&self) -> Capabilities;

    /// Gives the source the handle through which it reports its broker connection and
    /// assignments to the consumer's [`Health`](crate::health::Health). Called once, when the
    /// consumer is built. The default ignores it: the report then says
    /// [`BrokerStatus::Unknown`](crate::health::BrokerStatus::Unknown) and no assignment.
    /// A source that wraps another forwards it to the inner one.
    fn attach_health(&mut self, health: crate::health::SourceHealth) {
        let _ = health;
    }

    /// Gives the source the positions of the consumer it belongs to: the consumer's name and
    /// the store where the consumer writes each delivery's [`Position`] with its effects.
    /// Called once, by [`ConsumerBuilder::build`](crate::ConsumerBuilder::build), before the
    /// first [`receive`](MessageSource::receive).
    ///
    /// A source whose broker has positions (Kafka) reads them from here when it is assigned
    /// lanes, so it resumes exactly where the database's state ends. The default ignores them:
    /// right for a source without positions (AMQP, the in-memory broker); a source with
    /// positions that ignores them restarts from the broker's own offsets. A source that wraps
    /// another forwards it to the inner one. To drive a source without a consumer (a test
    /// calling `receive` directly), call it yourself with [`ConsumerPositions::new`].
    fn attach_positions(&mut self, positions: ConsumerPositions) {
        let _ = positions;
    }

    /// Releases the subscription after the runtime has drained and settled every delivery:
    /// flush offsets, cancel the consumer, close channels. Called exactly once, at shutdown.
    async fn close(self) -> Result<(), SourceError>
    where
        Self: Sized;
}

/// One received message and the right to settle it.
///
/// # Contract
///
/// - Settling consumes the delivery, so it can be settled at most once.
/// - A delivery **dropped without being settled** (shutdown, a crashed task) is *not
///   acknowledged*: the broker redelivers it (AMQP requeues when the channel closes, a Kafka
///   offset is not stored) and the inbox turns the redelivery into a duplicate if its effects
///   had committed.
/// - `settle` is not cancellation safe: if its future is dropped, the settlement may or may not
///   have reached the broker. Either outcome is safe because the runtime only settles after the
///   database transaction has ended.
/// - A delivery that wraps another forwards every method, the defaulted ones too
///   ([`position`](Delivery::position), [`reported_lane`](Delivery::reported_lane),
///   [`assignment`](Delivery::assignment)): their defaults are right for a plain source, not
///   for the one wrapped.
#[async_trait]
pub trait Delivery: Send + Sync + 'static {
    /// The message.
    fn message(&self) -> &Message;

    /// The ordering lane: deliveries of one lane are processed one at a time in receive order;
    /// different lanes run concurrently.
    fn lane(&self) -> Lane;

    /// The source position this delivery stands for, if the broker has positions (Kafka
    /// offsets): where it stands, for telling deliveries of a lane apart. What the runtime
    /// stores with the effects is [`position_to_store`](Self::position_to_store).
    fn position(&self) -> Option<Position> {
        None
    }

    /// The position the runtime stores with this delivery's effects (`None`: none): every
    /// message of its position lane before [`Position::next`] must be settled, or be this
    /// delivery, once its transaction commits. Called when the transaction is about to store
    /// it, so the answer may change over the delivery's life.
    ///
    /// A source whose position lanes are processed in order (one ordering [`Lane`] each)
    /// returns [`position`](Self::position). A source that lets one position lane run out of
    /// order (a Kafka partition split into lanes by record key) returns the contiguous settled
    /// prefix, counting this delivery as settled. It may be behind what is settled by the time
    /// the transaction commits; that costs only redeliveries after a restart, which the inbox
    /// turns into duplicates. It must never be ahead: a restart would skip what is not yet
    /// processed.
    ///
    /// Required, without a default, because a delivery that wraps another must forward it: a
    /// wrapper answering with the wrapped delivery's own [`position`](Self::position) would
    /// store positions past unprocessed messages under key ordering.
    fn position_to_store(&self) -> Option<Position>;

    /// The lane this delivery is reported under by [`Health`](crate::health::Health) and the
    /// per-lane gauges: the unit the broker assigns (a Kafka partition), which may hold many
    /// ordering lanes (one per record key). The default is [`lane`](Self::lane).
    fn reported_lane(&self) -> Lane {
        self.lane()
    }

    /// Which assignment of its lane this delivery belongs to, for sources that hand lanes out
    /// and take them back (Kafka: a partition's assignment to this consumer; each new
    /// assignment a new number). A lane the runtime stopped (a delivery of it left unsettled)
    /// runs again with the first delivery of another assignment, which starts at the stored
    /// position. `None`, the default: a stopped lane runs again only from a delivery at or
    /// before the one it stopped at.
    fn assignment(&self) -> Option<u64> {
        None
    }

    /// Ends the delivery on the broker.
    ///
    /// An error means the settlement did not (or may not) reach the broker; the broker will
    /// redeliver and the inbox will deduplicate. The runtime logs and counts it.
    async fn settle(self, settlement: Settlement) -> Result<(), SettleError>;
}

/// How a delivery ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settlement {
    /// Done: acknowledge (AMQP ack, Kafka offset stored).
    Ack,
    /// Deliver again after `after`. Only given to sources whose [`RetryMode`] is
    /// [`Redeliver`](RetryMode::Redeliver); the attempt is already counted in the inbox.
    Retry {
        /// How long to wait before redelivery.
        after: Duration,
    },
    /// Move to the broker's dead-letter destination, then acknowledge. The dead letter is
    /// already recorded durably in the inbox database when this is given.
    DeadLetter(DeadLetter),
}

/// The ordering lane of a delivery.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Lane {
    /// No ordering: processed concurrently with everything else (AMQP competing consumers).
    Unordered,
    /// Processed in receive order with every other delivery of the same key (a Kafka
    /// topic-partition, or a key inside it).
    Ordered(Arc<str>),
}

/// What the broker can do natively.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// `messaging.system` for telemetry: `kafka`, `rabbitmq`, `memory`.
    pub system: &'static str,
    /// How transient failures are retried.
    pub retry: RetryMode,
    /// The ID strategy used when the consumer does not configure one.
    pub default_id_strategy: IdStrategy,
}

/// How a source retries a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryMode {
    /// The broker can redeliver later ([`Settlement::Retry`]): AMQP retry queues, the in-memory
    /// source. The lane moves on meanwhile.
    Redeliver,
    /// The broker cannot (Kafka): the runtime keeps the delivery and re-runs it in place after
    /// the backoff, holding its lane so order is kept.
    InPlace,
}

/// A failure to receive from the broker, or to create a source. The adapter's error is its
/// [`source()`](std::error::Error::source).
#[derive(Debug)]
pub struct SourceError {
    transient: bool,
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl SourceError {
    /// A failure that may go away (connection lost, broker restarting): the runtime backs off
    /// and calls `receive` again.
    pub fn transient(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        SourceError {
            transient: true,
            source: source.into(),
        }
    }

    /// A failure that will not go away (bad credentials, unknown queue): the consumer stops.
    pub fn fatal(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        SourceError {
            transient: false,
            source: source.into(),
        }
    }

    /// Whether the runtime should retry.
    pub fn is_transient(&self) -> bool {
        self.transient
    }
}

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.transient { "transient" } else { "fatal" };
        write!(f, "{kind} source error: {}", self.source)
    }
}

impl std::error::Error for SourceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// A settlement that did not (or may not) reach the broker.
#[derive(Debug)]
pub struct SettleError(Box<dyn std::error::Error + Send + Sync>);

impl SettleError {
    /// Wraps the adapter's error.
    pub fn new(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        SettleError(source.into())
    }
}

impl fmt::Display for SettleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "settlement not confirmed: {}", self.0)
    }
}

impl std::error::Error for SettleError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}
