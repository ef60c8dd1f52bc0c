//! Positions: where a consumer is in a stream that has them (Kafka offsets), stored with the
//! effects so a restart or a database restore resumes exactly where the database's state ends.
//!
//! A delivery reports its [`Position`]; the runtime stores it in the message's transaction.
//! When the source is assigned lanes it reads them back through [`ConsumerPositions`], which
//! the consumer hands it when it is built
//! ([`MessageSource::attach_positions`](crate::MessageSource::attach_positions)): the consumer's
//! name and its store, together, so a source cannot read another consumer's positions.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

use crate::store::{InboxStore, StoreError};

/// A position in the source, stored with the effects so a restart or a database restore resumes
/// exactly where the database's state ends.
///
/// The stored value is overwritten, never maximised: a replayed or late delivery can move it
/// back, which only causes redeliveries the inbox absorbs, whereas moving it past a message not
/// yet processed would lose that message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    /// The stream, e.g. the Kafka topic.
    pub source: Arc<str>,
    /// The part of the stream, e.g. the partition number.
    pub lane: Arc<str>,
    /// The next position to read once this delivery is done (Kafka: offset + 1).
    pub next: i64,
}

/// Where positions are read back from: the part of an [`InboxStore`] a source needs, in a form
/// that can be shared as `Arc<dyn PositionStore>`.
///
/// Implemented for every [`InboxStore`]. Implement it yourself only for a source used without
/// a consumer (a test that calls `receive` directly) that must read positions from elsewhere.
#[async_trait]
pub trait PositionStore: Send + Sync + 'static {
    /// The stored next positions of `consumer` in `source`, by lane (Kafka: partition number as
    /// text → next offset); see [`InboxStore::load_positions`].
    async fn load(&self, consumer: &str, source: &str) -> Result<Vec<(String, i64)>, StoreError>;

    /// Records that `consumer` reads `source` of `system` through `subscription` (the Kafka
    /// consumer group); returns the subscription already recorded when it is a different one
    /// (see [`InboxStore::record_subscription`]). The default records nothing.
    async fn record_subscription(
        &self,
        consumer: &str,
        system: &str,
        source: &str,
        subscription: &str,
    ) -> Result<Option<String>, StoreError> {
        let _ = (consumer, system, source, subscription);
        Ok(None)
    }

    /// Moves `consumer`'s stored next position in `position`'s lane forward to
    /// `position.next`, never back, in a transaction of its own. For a source whose lanes
    /// settle out of order (the position stored with each transaction's effects may trail what
    /// is settled): it stores the final settled prefix when it gives a lane up, so the next
    /// reader does not read again what was settled. Every position before `position.next` must
    /// be settled. The default stores nothing.
    async fn advance(&self, consumer: &str, position: &Position) -> Result<(), StoreError> {
        let _ = (consumer, position);
        Ok(())
    }
}

#[async_trait]
impl<S: InboxStore> PositionStore for S {
    async fn load(&self, consumer: &str, source: &str) -> Result<Vec<(String, i64)>, StoreError> {
        self.load_positions(consumer, source).await
    }

    async fn record_subscription(
        &self,
        consumer: &str,
        system: &str,
        source: &str,
        subscription: &str,
    ) -> Result<Option<String>, StoreError> {
        InboxStore::record_subscription(self, consumer, system, source, subscription).await
    }

    async fn advance(&self, consumer: &str, position: &Position) -> Result<(), StoreError> {
        let mut tx = self.begin().await?;
        self.advance_position(&mut *tx, consumer, position).await?;
        self.commit(tx).await
    }
}

/// One consumer's positions: its name and the store it writes them to, bound together.
///
/// [`ConsumerBuilder::build`](crate::ConsumerBuilder::build) hands one to its source
/// ([`MessageSource::attach_positions`](crate::MessageSource::attach_positions)), so the source
/// reads exactly the positions its consumer writes: there is no second name to keep in step.
/// Cheap to clone.
#[derive(Clone)]
pub struct ConsumerPositions {
    consumer: Arc<str>,
    store: Arc<dyn PositionStore>,
}

impl ConsumerPositions {
    /// The positions `consumer` stores in `store`. The runtime makes this itself; call it only
    /// to drive a source without a consumer (then pass the name the consumer that writes the
    /// positions was built with).
    pub fn new(consumer: impl Into<Arc<str>>, store: impl PositionStore) -> Self {
        ConsumerPositions {
            consumer: consumer.into(),
            store: Arc::new(store),
        }
    }

    /// The consumer's name (given to [`Consumer::builder`](crate::Consumer::builder)).
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The consumer's stored next positions in `source`, by lane (Kafka: partition number as
    /// text → next offset).
    pub async fn load(&self, source: &str) -> Result<Vec<(String, i64)>, StoreError> {
        self.store.load(&self.consumer, source).await
    }

    /// Records that the consumer reads `source` of `system` through `subscription`; returns the
    /// subscription already recorded when it is a different one (see
    /// [`InboxStore::record_subscription`]).
    pub async fn record_subscription(
        &self,
        system: &str,
        source: &str,
        subscription: &str,
    ) -> Result<Option<String>, StoreError> {
        self.store
            .record_subscription(&self.consumer, system, source, subscription)
            .await
    }
}

impl ConsumerPositions {
    /// Moves the consumer's stored position in `position`'s lane forward to `position.next`,
    /// never back (see [`PositionStore::advance`]).
    pub async fn advance(&self, position: &Position) -> Result<(), StoreError> {
        self.store.advance(&self.consumer, position).await
    }
}

impl fmt::Debug for ConsumerPositions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerPositions")
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}
