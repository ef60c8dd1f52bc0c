//! How the relay is woken: `LISTEN` on PostgreSQL (read even while the relay is busy), nothing
//! on SQLite, which is polled.

#[cfg(feature = "postgres")]
use sqlx::postgres::PgListener;

use super::{OutboxPool, Relay};
use crate::outbox::Publisher;

impl<P: Publisher> Relay<P> {
    /// Listens for new rows; `None` on SQLite (no notifications: the relay polls).
    pub(super) async fn listen(&self) -> Option<Listener> {
        match &self.pool {
            #[cfg(feature = "postgres")]
            OutboxPool::Postgres(pool) => match crate::outbox::postgres::listen(pool).await {
                Ok(l) => Some(l),
                Err(e) => {
                    tracing::info!(relay = %self.config.name, error = %e, "outbox LISTEN failed; polling every {:?}", self.config.poll_interval);
                    None
                }
            },
            #[cfg(feature = "sqlite")]
            OutboxPool::Sqlite(_) => None,
        }
    }
}

/// A `LISTEN` connection (PostgreSQL only; SQLite has no notifications).
#[cfg(feature = "postgres")]
pub(super) type Listener = PgListener;
#[cfg(not(feature = "postgres"))]
pub(super) enum Listener {}

/// Completes on a notification (having read every one queued behind it: one round serves them
/// all) or when the listener fails (it is dropped; the relay listens again). Never without a
/// listener. Cancellation-safe.
///
/// The listener must be read even when the relay is busy or pausing: the server backend of an
/// unread listener blocks on its socket and holds back the server's NOTIFY queue for every
/// database, and once that queue is full every writer's COMMIT fails.
pub(super) async fn notified(listener: &mut Option<Listener>) {
    let Some(l) = listener.as_mut() else {
        return std::future::pending().await;
    };
    #[cfg(not(feature = "postgres"))]
    match *l {}
    #[cfg(feature = "postgres")]
    match l.recv().await {
        Ok(_) => while l.next_buffered().is_some() {},
        Err(e) => {
            tracing::info!(error = %e, "outbox LISTEN connection lost; polling until it is back");
            *listener = None;
        }
    }
}

/// Reads the notifications already received, without waiting (see [`notified`]).
pub(super) fn read_queued(listener: &mut Option<Listener>) {
    let Some(l) = listener.as_mut() else { return };
    #[cfg(not(feature = "postgres"))]
    match *l {}
    #[cfg(feature = "postgres")]
    loop {
        match futures::FutureExt::now_or_never(l.try_recv()) {
            Some(Ok(_)) => {}
            Some(Err(_)) => {
                *listener = None;
                return;
            }
            None => return,
        }
    }
}
