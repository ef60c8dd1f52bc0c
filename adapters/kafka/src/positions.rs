//! [`PositionStore`]: where the source reads the positions its consumer stored with its effects
//! (and records which consumer group reads a topic under the consumer's name).

use futures::future::BoxFuture;
use txinbox::{store::StoreError, InboxStore};

/// Where a source reads the positions its consumer stored with its effects.
///
/// Implemented for every [`InboxStore`] (through
/// [`InboxStore::load_positions`]); pass the consumer's store, e.g. `inbox.clone()`.
pub trait PositionStore: Send + Sync + 'static {
    /// The stored next offsets of `consumer` in `topic`: partition number as text → next
    /// offset.
    fn load<'a>(
        &'a self,
        consumer: &'a str,
        topic: &'a str,
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, StoreError>>;

    /// Records that `consumer` reads `topic` of `system` (`kafka`) through consumer group
    /// `group`; returns the group already recorded when it is a different one (see
    /// [`InboxStore::record_subscription`]). The default records nothing.
    fn record_subscription<'a>(
        &'a self,
        consumer: &'a str,
        system: &'a str,
        topic: &'a str,
        group: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, StoreError>> {
        let _ = (consumer, system, topic, group);
        Box::pin(async { Ok(None) })
    }
}

impl<S: InboxStore> PositionStore for S {
    fn load<'a>(
        &'a self,
        consumer: &'a str,
        topic: &'a str,
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, StoreError>> {
        self.load_positions(consumer, topic)
    }

    fn record_subscription<'a>(
        &'a self,
        consumer: &'a str,
        system: &'a str,
        topic: &'a str,
        group: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, StoreError>> {
        InboxStore::record_subscription(self, consumer, system, topic, group)
    }
}
