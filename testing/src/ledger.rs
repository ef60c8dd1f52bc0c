//! A deposit ledger whose handler is deliberately **not** idempotent, so a message applied twice
//! shows: the account's balance grows twice and `effects` gets a second row for the message ID.
//!
//! ```no_run
//! # async fn example(pool: txinbox::sqlx::PgPool) {
//! use txinbox_testing::ledger::{self, DepositHandler};
//!
//! ledger::create_tables(&pool).await;
//! let handler = DepositHandler::default();
//! // publish ledger::deposit("alice", 10) a few times under one message ID, run a consumer
//! // with `handler`, then: exactly one `effects` row for the ID, and alice's balance is 10.
//! # let _ = handler;
//! # }
//! ```
//!
//! The tables (in the database's default schema):
//!
//! - `accounts (id, balance)`: `balance += amount` per application.
//! - `effects (seq, message_id, amount, lane, idx, topic, part, off, run)`: one row per
//!   application. `lane` and `idx` come from the payload ([`deposit_in_lane`]); `topic`,
//!   `part` and `off` from the message's origin (destination, partition and offset, -1 when the
//!   source has none); `run` from [`DepositHandler::tagged`].
//! - `blocked (account)`: accounts a [`refusing_blocked`](DepositHandler::refusing_blocked)
//!   handler fails permanently.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use txinbox::sqlx::{self, PgPool, Postgres};
use txinbox::{async_trait, message::Headers, Context, Handler, HandlerError, Message};

/// Creates `accounts`, `effects` and `blocked` (see the [module](self) docs).
///
/// # Panics
///
/// When a table already exists or the database refuses.
pub async fn create_tables(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL);
         CREATE TABLE effects (seq bigserial PRIMARY KEY, message_id text NOT NULL, amount bigint NOT NULL,
                               lane text, idx bigint, topic text, part integer, off bigint,
                               run integer NOT NULL);
         CREATE INDEX ON effects (message_id);
         CREATE TABLE blocked (account text PRIMARY KEY);",
    )
    .execute(pool)
    .await
    .expect("create the ledger's tables");
}

/// A deposit's payload: `{"account": …, "amount": …}`.
pub fn deposit(account: &str, amount: i64) -> String {
    format!(r#"{{"account":"{account}","amount":{amount}}}"#)
}

/// A deposit's payload that also names its lane and its index in the lane, which the handler
/// copies to `effects.lane` and `effects.idx` to check the order of application.
pub fn deposit_in_lane(account: &str, amount: i64, lane: &str, idx: u64) -> String {
    format!(r#"{{"account":"{account}","amount":{amount},"lane":"{lane}","idx":{idx}}}"#)
}

#[derive(serde::Deserialize)]
struct Deposit {
    account: String,
    amount: i64,
    lane: Option<String>,
    idx: Option<i64>,
}

/// One start of the handler on a message.
#[derive(Debug, Clone)]
pub struct Start {
    /// The message ID.
    pub id: String,
    /// When the handler started.
    pub at: Instant,
    /// The attempt, from 1.
    pub attempt: u32,
    /// The message's headers.
    pub headers: Headers,
}

type FailFn = dyn Fn(&Message, u32) -> Option<HandlerError> + Send + Sync;

/// Applies a deposit: `accounts.balance += amount` and one `effects` row, in the inbox's
/// transaction. Clones share their records ([`calls`](Self::calls), [`starts`](Self::starts)).
#[derive(Clone)]
pub struct DepositHandler {
    fail: Arc<FailFn>,
    hold: Duration,
    block_forever: bool,
    refuse_blocked: bool,
    run: i32,
    calls: Arc<AtomicUsize>,
    after_commit: Arc<AtomicUsize>,
    starts: Arc<Mutex<Vec<Start>>>,
    entered: Arc<tokio::sync::Notify>,
}

impl Default for DepositHandler {
    fn default() -> Self {
        DepositHandler {
            fail: Arc::new(|_, _| None),
            hold: Duration::ZERO,
            block_forever: false,
            refuse_blocked: false,
            run: 0,
            calls: Arc::default(),
            after_commit: Arc::default(),
            starts: Arc::default(),
            entered: Arc::default(),
        }
    }
}

impl fmt::Debug for DepositHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DepositHandler")
            .field("hold", &self.hold)
            .field("block_forever", &self.block_forever)
            .field("refuse_blocked", &self.refuse_blocked)
            .field("run", &self.run)
            .field("calls", &self.calls())
            .finish_non_exhaustive()
    }
}

impl DepositHandler {
    /// Fails, before writing anything, with whatever `f(message, attempt)` returns.
    pub fn failing(f: impl Fn(&Message, u32) -> Option<HandlerError> + Send + Sync + 'static) -> Self {
        DepositHandler {
            fail: Arc::new(f),
            ..Default::default()
        }
    }

    /// Keeps the transaction open this long after writing the effect.
    pub fn holding(mut self, d: Duration) -> Self {
        self.hold = d;
        self
    }

    /// Writes the effect, signals [`entered`](Self::entered), then never returns: a test
    /// simulates a crash mid-handler by dropping the consumer.
    pub fn blocking_forever(mut self) -> Self {
        self.block_forever = true;
        self
    }

    /// Fails permanently, before writing anything, for an account listed in `blocked` (the
    /// cause an operator fixes before requeueing a dead letter).
    pub fn refusing_blocked(mut self) -> Self {
        self.refuse_blocked = true;
        self
    }

    /// Writes `run` into each `effects` row, to tell apart the consumers that applied them.
    pub fn tagged(mut self, run: i32) -> Self {
        self.run = run;
        self
    }

    /// Handler calls, re-runs included (a transaction that lost a lock conflict runs again).
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Calls for a message whose effect had already committed: a duplicate reached the
    /// handler. Zero whenever the inbox does its job.
    pub fn after_commit(&self) -> usize {
        self.after_commit.load(Ordering::SeqCst)
    }

    /// Every start of the handler, in order.
    pub fn starts(&self) -> Vec<Start> {
        self.starts.lock().unwrap().clone()
    }

    /// The starts on message `id`.
    pub fn starts_of(&self, id: &str) -> Vec<Start> {
        self.starts
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.id == id)
            .cloned()
            .collect()
    }

    /// How many times the handler started, per message ID.
    pub fn start_counts(&self) -> HashMap<String, u32> {
        let mut counts = HashMap::new();
        for s in self.starts.lock().unwrap().iter() {
            *counts.entry(s.id.clone()).or_default() += 1;
        }
        counts
    }

    /// The message IDs the handler was called with.
    pub fn seen(&self) -> HashSet<String> {
        self.starts.lock().unwrap().iter().map(|s| s.id.clone()).collect()
    }

    /// Notified when a [`blocking_forever`](Self::blocking_forever) handler has written its
    /// effect and blocks.
    pub fn entered(&self) -> Arc<tokio::sync::Notify> {
        self.entered.clone()
    }
}

#[async_trait]
impl Handler<Postgres> for DepositHandler {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let id = cx.message_id().to_string();
        self.starts.lock().unwrap().push(Start {
            id: id.clone(),
            at: Instant::now(),
            attempt: cx.attempt(),
            headers: msg.headers().clone(),
        });
        if let Some(e) = (self.fail)(msg, cx.attempt()) {
            return Err(e);
        }
        let d: Deposit = msg.json()?;
        if self.refuse_blocked {
            let blocked: Option<i32> = sqlx::query_scalar("SELECT 1 FROM blocked WHERE account = $1")
                .bind(&d.account)
                .fetch_optional(cx.db())
                .await?;
            if blocked.is_some() {
                return Err(HandlerError::permanent(format!(
                    "account {} is blocked",
                    d.account
                )));
            }
        }
        let committed: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM effects WHERE message_id = $1)")
                .bind(&id)
                .fetch_one(cx.db())
                .await?;
        if committed {
            self.after_commit.fetch_add(1, Ordering::SeqCst);
        }
        sqlx::query(
            "INSERT INTO accounts (id, balance) VALUES ($1, $2)
             ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        )
        .bind(&d.account)
        .bind(d.amount)
        .execute(cx.db())
        .await?;
        let origin = msg.origin();
        sqlx::query(
            "INSERT INTO effects (message_id, amount, lane, idx, topic, part, off, run)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&id)
        .bind(d.amount)
        .bind(&d.lane)
        .bind(d.idx)
        .bind(&*origin.destination)
        .bind(origin.partition.unwrap_or(-1))
        .bind(origin.offset.unwrap_or(-1))
        .bind(self.run)
        .execute(cx.db())
        .await?;
        if self.block_forever {
            self.entered.notify_one();
            std::future::pending::<()>().await;
        }
        if !self.hold.is_zero() {
            tokio::time::sleep(self.hold).await;
        }
        Ok(())
    }
}
