//! The deposits service's own code: its table and its handler. `main.rs` wires them to Kafka,
//! PostgreSQL and the outbox relay; `tests/handler.rs` tests the handler alone.

use serde::{Deserialize, Serialize};
use txinbox::outbox::OutboxMessage;
use txinbox::sqlx::{self, PgPool, Postgres};
use txinbox::{Context, Handler, HandlerError, Message};

/// The service's table, created at start if missing. txinbox's tables live apart, in schema
/// `txinbox` ([`txinbox::postgres::migrate`]).
pub const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS accounts (id TEXT PRIMARY KEY, balance BIGINT NOT NULL)";

/// Creates the service's table (idempotent; a larger service would use its migration tool).
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(SCHEMA).execute(pool).await?;
    Ok(())
}

/// A deposit event, as producers send it.
#[derive(Debug, Deserialize)]
pub struct Deposit {
    /// The account credited.
    pub account: String,
    /// In cents; positive.
    pub amount: i64,
}

/// The event the service announces for each applied deposit.
#[derive(Debug, Serialize)]
struct Applied<'a> {
    account: &'a str,
    amount: i64,
    balance: i64,
}

/// Credits each deposit to its account and announces the new balance on `events_topic`
/// through the outbox: both in the inbox transaction, so both happen once or not at all.
#[derive(Debug, Clone)]
pub struct Deposits {
    /// Where the relay publishes the `Applied` events.
    pub events_topic: String,
}

#[txinbox::async_trait]
impl Handler<Postgres> for Deposits {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let deposit: Deposit = msg.json()?; // undecodable: dead-lettered at once, never retried
        if deposit.amount <= 0 {
            return Err(HandlerError::permanent(format!(
                "a deposit of {} to {}: amounts must be positive",
                deposit.amount, deposit.account
            )));
        }
        let balance: i64 = sqlx::query_scalar(
            "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance \
             RETURNING balance",
        )
        .bind(&deposit.account)
        .bind(deposit.amount)
        .fetch_one(cx.db())
        .await?; // a database error is transient: rolled back, retried with backoff
        let applied = Applied {
            account: &deposit.account,
            amount: deposit.amount,
            balance,
        };
        let event = serde_json::to_vec(&applied).map_err(HandlerError::permanent)?;
        // The same ID on every attempt: a retried handler writes the same outbox row.
        let message = OutboxMessage::new(cx.derive_id("applied"), &self.events_topic, event)
            .with_key(deposit.account.clone());
        cx.outbox(&message).await?;
        Ok(())
    }
}
