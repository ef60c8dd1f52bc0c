//! The ledger's events, tables and handler: the effect the `ledger` example applies and the
//! `chaos` harness checks.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use txinbox::sqlx::{self, PgPool, Postgres};
use txinbox::{
    async_trait, handler::BatchContext, handler::BatchHandler, handler::BatchMessage, Context, Handler,
    HandlerError, Message,
};

/// A payment event, the message payload: `{"account": "<id>", "amount_cents": <i64>}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payment {
    /// The account the amount is booked to.
    pub account: String,
    /// Signed amount in cents: deposits are positive, withdrawals negative.
    pub amount_cents: i64,
}

/// The ledger's own tables, created if missing.
///
/// `ledger_entries` has deliberately **no** unique constraint on `event_id`: the inbox is what
/// keeps an event from being applied twice, and a second application must stay visible to the
/// crash-matrix check instead of being hidden by a constraint violation.
const CREATE_TABLES: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS accounts (
        account       text   PRIMARY KEY,
        balance_cents bigint NOT NULL
    )",
    "CREATE TABLE IF NOT EXISTS ledger_entries (
        id           bigserial   PRIMARY KEY,
        event_id     text        NOT NULL,
        account      text        NOT NULL,
        amount_cents bigint      NOT NULL,
        applied_at   timestamptz NOT NULL DEFAULT now()
    )",
    "CREATE INDEX IF NOT EXISTS ledger_entries_event_id_idx ON ledger_entries (event_id)",
];

/// Creates the ledger's tables if they are missing. Safe to run from several instances at once
/// (serialised by an advisory lock: concurrent `CREATE TABLE IF NOT EXISTS` can otherwise fail).
pub async fn create_tables(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    // An arbitrary constant naming "the ledger's schema" for pg_advisory_xact_lock.
    sqlx::query("SELECT pg_advisory_xact_lock(7401552019)")
        .execute(&mut *tx)
        .await?;
    for statement in CREATE_TABLES {
        sqlx::query(statement).execute(&mut *tx).await?;
    }
    tx.commit().await
}

/// Applies a payment: `accounts.balance_cents += amount_cents` (upsert) and one row in
/// `ledger_entries`. Not idempotent at all: applied twice, the balance is off and the entry
/// doubled. The inbox makes it effectively once.
///
/// A payload that is not a payment (bad JSON, missing fields, empty account) is a permanent
/// error with reason `undecodable`: dead-lettered, never retried, never a crash. Database errors
/// are transient and retried with backoff.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ledger;

#[async_trait]
impl Handler<Postgres> for Ledger {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let payment = decode(msg)?;
        let event_id = cx.message_id().as_str().to_owned();
        sqlx::query(
            "INSERT INTO accounts (account, balance_cents) VALUES ($1, $2)
             ON CONFLICT (account) DO UPDATE SET balance_cents = accounts.balance_cents + EXCLUDED.balance_cents",
        )
        .bind(&payment.account)
        .bind(payment.amount_cents)
        .execute(cx.db())
        .await?;
        sqlx::query("INSERT INTO ledger_entries (event_id, account, amount_cents) VALUES ($1, $2, $3)")
            .bind(&event_id)
            .bind(&payment.account)
            .bind(payment.amount_cents)
            .execute(cx.db())
            .await?;
        Ok(())
    }

    fn batch(&self) -> Option<&dyn BatchHandler<Postgres>> {
        Some(self)
    }
}

/// A micro-batch (the runtime's default) is applied with two statements: one upsert of every
/// account it touches, **in account order**, and one insert of all its ledger entries. The
/// order matters: batches of different lanes touching the same accounts then take those row
/// locks in the same order and cannot deadlock (a deadlock costs PostgreSQL's 1 s detection
/// and turns batching off for a while). One payment that is not a payment fails the batch; the
/// runtime then runs each message alone through [`Handler::handle`], which dead-letters it.
#[async_trait]
impl BatchHandler<Postgres> for Ledger {
    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, Postgres>,
        batch: &[BatchMessage<'_>],
    ) -> Result<(), HandlerError> {
        let mut totals: BTreeMap<String, i64> = BTreeMap::new();
        let (mut event_ids, mut accounts, mut amounts) = (Vec::new(), Vec::new(), Vec::new());
        for m in batch {
            let payment = decode(m.message())?;
            *totals.entry(payment.account.clone()).or_default() += payment.amount_cents;
            event_ids.push(m.id().as_str());
            accounts.push(payment.account);
            amounts.push(payment.amount_cents);
        }
        let (sorted_accounts, sums): (Vec<String>, Vec<i64>) = totals.into_iter().unzip();
        sqlx::query(
            "INSERT INTO accounts (account, balance_cents)
             SELECT account, cents FROM UNNEST($1::text[], $2::bigint[]) WITH ORDINALITY AS t(account, cents, n)
             ORDER BY n
             ON CONFLICT (account) DO UPDATE SET balance_cents = accounts.balance_cents + EXCLUDED.balance_cents",
        )
        .bind(&sorted_accounts)
        .bind(&sums)
        .execute(cx.db())
        .await?;
        sqlx::query(
            "INSERT INTO ledger_entries (event_id, account, amount_cents)
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::bigint[])",
        )
        .bind(&event_ids)
        .bind(&accounts)
        .bind(&amounts)
        .execute(cx.db())
        .await?;
        Ok(())
    }
}

/// The payment in `msg`, or an `undecodable` error (dead-lettered, never retried).
fn decode(msg: &Message) -> Result<Payment, HandlerError> {
    let payment: Payment = msg.json()?;
    if payment.account.trim().is_empty() {
        return Err(HandlerError::undecodable("the payment's account is empty"));
    }
    Ok(payment)
}
