//! The effect: one effect row per message, or one UNNEST insert per batch.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};
use std::time::Duration;

use txinbox::sqlx::{self, Postgres};
use txinbox::{
    async_trait, handler::BatchContext, handler::BatchHandler, handler::BatchMessage, Context, Handler,
    HandlerError, Message,
};

pub(crate) struct Effects;

/// Handler calls and the messages they handled, for the batched rows' average batch fill (a
/// message that runs alone, on a lane with nothing else queued, is a call of one). Reset before
/// each row; rows run one at a time.
pub(crate) static HANDLER_CALLS: AtomicU64 = AtomicU64::new(0);
pub(crate) static HANDLED: AtomicU64 = AtomicU64::new(0);

pub(crate) fn count_call(messages: usize) {
    HANDLER_CALLS.fetch_add(1, Ordering::Relaxed);
    HANDLED.fetch_add(messages as u64, Ordering::Relaxed);
}

#[async_trait]
impl Handler<Postgres> for Effects {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        count_call(1);
        let id = cx.message_id().as_str().to_owned();
        sqlx::query("INSERT INTO bench_effects (message_id, bytes) VALUES ($1, $2)")
            .bind(id)
            .bind(msg.payload().len() as i64)
            .execute(cx.db())
            .await?;
        Ok(())
    }
    fn batch(&self) -> Option<&dyn BatchHandler<Postgres>> {
        Some(self)
    }
}

#[async_trait]
impl BatchHandler<Postgres> for Effects {
    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, Postgres>,
        batch: &[BatchMessage<'_>],
    ) -> Result<(), HandlerError> {
        count_call(batch.len());
        let ids: Vec<&str> = batch.iter().map(|m| m.id().as_str()).collect();
        let sizes: Vec<i64> = batch.iter().map(|m| m.message().payload().len() as i64).collect();
        sqlx::query(
            "INSERT INTO bench_effects (message_id, bytes) SELECT * FROM UNNEST($1::text[], $2::int8[])",
        )
        .bind(ids)
        .bind(sizes)
        .execute(cx.db())
        .await?;
        Ok(())
    }
}

/// A handler waiting on slow I/O: asks PostgreSQL its transaction's ID and how long that
/// transaction has run, then sleeps. What it learns goes to [`slow_transactions`].
pub(crate) struct Sleepy(pub(crate) Duration);

static SLOW_TRANSACTIONS: LazyLock<Mutex<HashMap<i64, (u64, f64)>>> = LazyLock::new(Mutex::default);

/// The sleeping handler's transactions in the current row: transaction ID → (messages, how
/// long it had run when its last handler ended, ms). Cleared before each row.
pub(crate) fn slow_transactions() -> MutexGuard<'static, HashMap<i64, (u64, f64)>> {
    SLOW_TRANSACTIONS.lock().unwrap_or_else(|e| e.into_inner())
}

#[async_trait]
impl Handler<Postgres> for Sleepy {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, _msg: &Message) -> Result<(), HandlerError> {
        let (txid, ran_ms): (i64, f64) = sqlx::query_as(
            "SELECT txid_current(), extract(epoch FROM clock_timestamp() - now())::float8 * 1000",
        )
        .fetch_one(cx.db())
        .await?;
        tokio::time::sleep(self.0).await;
        let ran_ms = ran_ms + self.0.as_secs_f64() * 1000.0;
        let mut txs = slow_transactions();
        let t = txs.entry(txid).or_default();
        t.0 += 1;
        t.1 = t.1.max(ran_ms);
        Ok(())
    }
}
