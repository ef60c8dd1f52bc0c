//! How the consumer waits out the database: backoffs for an unavailable database and for lost
//! lock conflicts, and when a failing store operation pauses intake or stops the consumer.

use std::time::Duration;

use super::Shared;
use crate::error::Error;
use crate::retry::Backoff;
use crate::store::{InboxStore, StoreError};

/// Backoff for an unavailable inbox database: 100 ms doubling to 5 s, 50–100 % jitter.
pub(crate) fn store_backoff(attempt: u32) -> Duration {
    const STORE: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    STORE.half_jitter(attempt)
}

/// Backoff before re-running a transaction that lost a lock conflict: 10 ms doubling to 1 s,
/// 50–100 % jitter. Short, because the transaction it collided with usually ends within
/// milliseconds; jittered, so the two do not collide again in step.
pub(crate) fn contention_backoff(conflicts: u32) -> Duration {
    const CONTENTION: Backoff = Backoff::new(Duration::from_millis(10), Duration::from_secs(1));
    CONTENTION.half_jitter(conflicts)
}

/// Runs a short store operation until it succeeds, backing off while the database is
/// unavailable. `None` on shutdown or a fatal error.
pub(super) async fn with_store<St, H, T, F, Fut>(shared: &Shared<St, H>, mut op: F) -> Option<T>
where
    St: InboxStore,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut failures = 0;
    loop {
        match op().await {
            Ok(v) => {
                shared.set_healthy(true);
                return Some(v);
            }
            Err(e) => {
                failures += 1;
                store_unavailable(shared, e, failures)?;
                if !shared.sleep(store_backoff(failures)).await {
                    return None;
                }
            }
        }
    }
}

/// Consecutive "busy" failures of one operation (a saturated pool, a statement timeout) after
/// which the database is reported unavailable: with the backoff between them (100 ms doubling),
/// some seconds plus six acquire timeouts.
const BUSY_BEFORE_OUTAGE: u32 = 6;

/// Pauses intake while the database is unavailable; stops the consumer on a fatal error
/// (`None`); contention only backs off the message, as does a busy database until it has been
/// busy for [`BUSY_BEFORE_OUTAGE`] tries.
pub(super) fn store_unavailable<St, H>(shared: &Shared<St, H>, e: StoreError, failures: u32) -> Option<()> {
    if !e.is_transient() {
        shared.fail(Error::Store(e));
        return None;
    }
    if !e.is_unavailable() && failures < BUSY_BEFORE_OUTAGE {
        // A lock conflict, a timeout, a saturated pool: the database is up. This message backs
        // off, intake goes on, and it is not counted or reported as an outage.
        tracing::info!(error = %e, "inbox transaction could not run now; backing off");
        return Some(());
    }
    if !e.is_unavailable() && failures == BUSY_BEFORE_OUTAGE {
        // Busy for this long looks like an outage from here, and may be one: a server that
        // stopped answering leaves every pooled connection stuck in its transaction, so the
        // pool is "full" until TCP gives up. Pause intake and say so.
        tracing::warn!(error = %e, failures, "inbox database busy for too long; treating it as unavailable");
    }
    shared.metrics.store_errors.increment(1);
    if failures == 1 {
        tracing::warn!(error = %e, "inbox database unavailable; backing off");
    }
    shared.set_healthy(false);
    Some(())
}
