//! User code: [`Handler`], the [`Context`] it runs in, and the [`HandlerError`] it returns.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;

use crate::dead_letter::DeadLetterReason;
use crate::message::{Message, MessageId};
use crate::tracked::TrackedTransaction;

/// Processes one new message inside the inbox transaction.
///
/// The handler runs only for messages the inbox has not processed or dead-lettered (a message
/// whose earlier attempt failed runs again, with [`Context::attempt`] counting up). Everything
/// it writes through [`Context::db`] commits together with the inbox row, or not at all. It must
/// not commit, roll back or otherwise end the transaction, and it should not cause effects
/// outside the database (publish through an outbox instead): those are not rolled back on
/// failure. A handler that ends the transaction anyway is caught before COMMIT (the check asks
/// whether this transaction still holds its claim, not whether the row exists, which another
/// worker's redelivery could make true), and its messages run again, each alone; but what it
/// and the handlers after it wrote on the connection in autocommit stays written.
///
/// Propagate database errors with `?`. On PostgreSQL a failed statement aborts the whole
/// transaction; a handler that ignores the error and returns `Ok` is caught before COMMIT (the
/// attempt fails and is retried), but it has wasted the attempt.
///
/// `DB` is the sqlx database of the inbox store (`sqlx::Postgres` for
/// [`PostgresInbox`](crate::PostgresInbox)).
///
/// ```no_run
/// use txinbox::{Context, Handler, HandlerError, Message};
///
/// struct Deposit;
///
/// #[derive(serde::Deserialize)]
/// struct Event { account: String, amount: i64 }
///
/// #[async_trait::async_trait]
/// impl Handler<sqlx::Postgres> for Deposit {
///     async fn handle(&self, cx: &mut Context<'_, sqlx::Postgres>, msg: &Message) -> Result<(), HandlerError> {
///         let event: Event = msg.json()?; // undecodable → permanent → dead-lettered
///         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///             .bind(event.amount)
///             .bind(&event.account)
///             .execute(cx.db())
///             .await?; // database errors are transient: retried with backoff
///         Ok(())
///     }
/// }
/// ```
#[async_trait]
#[diagnostic::on_unimplemented(
    note = "implement `txinbox::Handler<sqlx::Postgres>` (with #[async_trait]) for your handler type"
)]
pub trait Handler<DB: sqlx::Database>: Send + Sync + 'static {
    /// Applies the message's effects using `cx.db()`.
    ///
    /// A panic is caught and treated as a transient error; the transaction is rolled back.
    async fn handle(&self, cx: &mut Context<'_, DB>, msg: &Message) -> Result<(), HandlerError>;

    /// The bulk form of this handler, if it has one (see [`BatchHandler`]). The default,
    /// `None`, makes the runtime call [`handle`](Self::handle) once per new message of a
    /// micro-batch, in lane order, on the batch's transaction. Return `Some(self)` from a type
    /// that also implements [`BatchHandler`].
    fn batch(&self) -> Option<&dyn BatchHandler<DB>> {
        None
    }
}

/// What a handler gets besides the message: the open transaction and facts about the attempt.
pub struct Context<'a, DB: sqlx::Database> {
    pub(crate) conn: &'a mut TrackedTransaction<DB>,
    pub(crate) consumer: &'a str,
    pub(crate) id: &'a MessageId,
    pub(crate) attempt: u32,
}

impl<DB: sqlx::Database> Context<'_, DB> {
    /// The inbox transaction. Write your effects here: `sqlx::query(..).execute(cx.db())`
    /// (it derefs to the connection where a function wants one). If a statement run on it
    /// fails, nothing of this attempt commits, whatever the handler returns: propagate the
    /// error, or see [`TrackedTransaction`] to recover from a failure you expect.
    pub fn db(&mut self) -> &mut TrackedTransaction<DB> {
        self.conn
    }

    /// The consumer's name.
    pub fn consumer(&self) -> &str {
        self.consumer
    }

    /// The message ID the inbox deduplicates on.
    pub fn message_id(&self) -> &MessageId {
        self.id
    }

    /// Which attempt this is, starting at 1. Counted in the database, so it survives restarts
    /// and is the same whichever consumer instance runs it.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// A downstream message ID derived from the consumer's name, this message's ID and `step`
    /// ([`outbox::derive_id`](crate::outbox::derive_id)): the same on every attempt, so a
    /// retried handler writes the same outbox rows, and different for another consumer
    /// handling the same message.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub fn derive_id(&self, step: &str) -> String {
        crate::outbox::derive_id(self.consumer, self.id.as_str(), step)
    }
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl<DB: crate::outbox::OutboxDatabase + crate::TrackedDatabase> Context<'_, DB> {
    /// Writes `message` into the outbox in this transaction: it is published only if the
    /// handler's effects commit. `Ok(false)`: this very message is in the outbox already and
    /// nothing was written; another message with its ID is an error that dead-letters the
    /// incoming message when propagated with `?` (see [`outbox::write`](crate::outbox::write)).
    pub async fn outbox(
        &mut self,
        message: &crate::outbox::OutboxMessage,
    ) -> Result<bool, crate::outbox::WriteError> {
        crate::outbox::write(&mut *self.conn, message).await
    }
}

impl<DB: sqlx::Database> fmt::Debug for Context<'_, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("consumer", &self.consumer)
            .field("message_id", &self.id)
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

/// Why a handler failed, and whether trying again can help.
///
/// Any error converts into a `HandlerError`, so `?` works. Most become **transient**: the
/// message is retried with backoff. Say [`HandlerError::permanent`] when a retry cannot succeed
/// (invalid business data): the message is dead-lettered at once and its lane moves on.
///
/// Errors that the same bytes repeat on every attempt convert into permanent ones by
/// themselves: a `serde_json::Error` that is not an I/O error
/// (syntax, data, cut short: `serde_json::from_slice(msg.payload())?` is dead-lettered
/// `undecodable` on its first attempt, as [`Message::json`] is), a UTF-8 error, and an outbox
/// write that can never succeed. For another codec, decode through [`Message::decode`] or say
/// `.map_err(HandlerError::undecodable)?`: the blanket conversion cannot recognise a type it does
/// not know. Conversely, wrap a JSON error in [`HandlerError::transient`] when it comes from
/// something that may answer differently next time (a remote service's response body).
///
/// `HandlerError` deliberately does not implement [`std::error::Error`] (like `anyhow::Error`),
/// which is what makes the blanket `From` possible.
pub struct HandlerError {
    kind: Kind,
    reason: DeadLetterReason,
    source: Box<dyn std::error::Error + Send + Sync>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Transient { retry_after: Option<Duration> },
    Permanent,
}

impl HandlerError {
    /// A failure that may succeed on a later attempt (the default for `?`).
    pub fn transient(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        HandlerError {
            kind: Kind::Transient { retry_after: None },
            reason: DeadLetterReason::AttemptsExhausted,
            source: source.into(),
        }
    }

    /// A failure no retry can fix: the message is dead-lettered with reason `permanent_error`.
    pub fn permanent(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        HandlerError {
            kind: Kind::Permanent,
            reason: DeadLetterReason::Permanent,
            source: source.into(),
        }
    }

    /// A payload that cannot be decoded: permanent, reason `undecodable`.
    pub fn undecodable(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        HandlerError {
            kind: Kind::Permanent,
            reason: DeadLetterReason::Undecodable,
            source: source.into(),
        }
    }

    /// Asks for the next attempt no sooner than `delay` (for example a rate limit's
    /// `Retry-After`). Makes the error transient.
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.kind = Kind::Transient {
            retry_after: Some(delay),
        };
        self.reason = DeadLetterReason::AttemptsExhausted;
        self
    }

    /// Whether the error is permanent.
    pub fn is_permanent(&self) -> bool {
        self.kind == Kind::Permanent
    }

    /// The delay the handler asked for, if any.
    pub fn requested_delay(&self) -> Option<Duration> {
        match self.kind {
            Kind::Transient { retry_after } => retry_after,
            Kind::Permanent => None,
        }
    }

    pub(crate) fn with_reason(mut self, reason: DeadLetterReason) -> Self {
        self.reason = reason;
        self
    }

    pub(crate) fn reason(&self) -> DeadLetterReason {
        self.reason
    }

    /// Whether the error is a database lock conflict rather than the message's fault (see
    /// [`StoreError::is_contention`](crate::store::StoreError::is_contention)): the error, or one of
    /// its causes, is a `sqlx::Error` that lost a lock conflict, or such a `StoreError`. A
    /// handler that propagates its database errors with `?` gets this for free; one that
    /// wraps them must keep them as the error's `source()`.
    pub(crate) fn is_contention(&self) -> bool {
        self.database_cause(
            crate::store::is_lock_conflict,
            crate::store::StoreError::is_contention,
        )
    }

    /// Whether the error is the database being unavailable ([`crate::store::is_unavailable`]: its
    /// session ended, the server shutting down, the connection lost), found the same way as
    /// [`is_contention`](Self::is_contention). An outage is not the message's fault: the runtime
    /// pauses intake and re-runs the message without counting an attempt.
    pub(crate) fn is_unavailable(&self) -> bool {
        self.database_cause(
            crate::store::is_unavailable,
            crate::store::StoreError::is_unavailable,
        )
    }

    /// The error's source, e.g. to keep it as the source of a [`StoreError`](crate::store::StoreError).
    pub(crate) fn into_source(self) -> Box<dyn std::error::Error + Send + Sync> {
        self.source
    }

    /// Applies `sqlx` or `store` to the first database error among the error and its causes.
    fn database_cause(
        &self,
        sqlx: fn(&sqlx::Error) -> bool,
        store: fn(&crate::store::StoreError) -> bool,
    ) -> bool {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&*self.source);
        while let Some(e) = cause {
            if let Some(e) = e.downcast_ref::<sqlx::Error>() {
                return sqlx(e);
            }
            if let Some(e) = e.downcast_ref::<crate::store::StoreError>() {
                return store(e);
            }
            cause = e.source();
        }
        false
    }
}

impl<E> From<E> for HandlerError
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn from(e: E) -> Self {
        let source: Box<dyn std::error::Error + Send + Sync> = e.into();
        // An outbox message that can never be written (invalid, or its ID taken by another
        // message) would only burn the attempts: dead-letter it at once.
        #[cfg(any(feature = "postgres", feature = "sqlite"))]
        if source
            .downcast_ref::<crate::outbox::WriteError>()
            .is_some_and(crate::outbox::WriteError::is_permanent)
        {
            return HandlerError::permanent(source);
        }
        if undecodable_error(&*source) {
            return HandlerError::undecodable(source);
        }
        HandlerError::transient(source)
    }
}

/// Whether `e` says that bytes cannot be decoded, so that no retry can succeed: a
/// `serde_json::Error` of category syntax, data or EOF (an I/O error from a reader is
/// transient), a [`std::str::Utf8Error`] or a [`std::string::FromUtf8Error`]. The one rule the
/// blanket `From` (and so `?` in a handler) applies to make a decode error permanent with
/// reason `undecodable`; only the error itself is looked at, not its `source()` chain (a
/// wrapped decode error may come from a peer that answers differently next time).
pub(crate) fn undecodable_error(e: &(dyn std::error::Error + 'static)) -> bool {
    if let Some(e) = e.downcast_ref::<serde_json::Error>() {
        return !e.is_io();
    }
    e.is::<std::str::Utf8Error>() || e.is::<std::string::FromUtf8Error>()
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("kind", &self.kind)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

/// A handler that applies all new messages of a micro-batch at once: one `INSERT … SELECT FROM
/// UNNEST(…)` or `COPY` instead of one statement per message.
///
/// It is the optional companion of a [`Handler`]: implement both on one type and return
/// `Some(self)` from [`Handler::batch`]. The runtime calls
/// [`handle_batch`](BatchHandler::handle_batch) with every message of a batch the inbox claimed
/// as new (duplicates are left out), in lane order, on the batch's transaction. It calls
/// [`Handler::handle`] instead for a message that travels alone: a batch of one, a retry, and
/// every message of a batch whose `handle_batch` failed.
///
/// # Failure
///
/// An error (or a panic) rolls the whole batch back. The runtime cannot tell which message
/// caused it, so it processes each of that batch's messages once more, one at a time, through
/// [`Handler::handle`]; only those attempts count, retry and dead-letter. `handle_batch` must
/// therefore have the same effect as calling `handle` for each message in order.
///
/// ```no_run
/// use txinbox::{handler::BatchContext, handler::BatchHandler, handler::BatchMessage, Context, Handler, HandlerError, Message};
///
/// struct Effects;
///
/// #[txinbox::async_trait]
/// impl Handler<sqlx::Postgres> for Effects {
///     async fn handle(&self, cx: &mut Context<'_, sqlx::Postgres>, msg: &Message) -> Result<(), HandlerError> {
///         sqlx::query("INSERT INTO effects (message_id, body) VALUES ($1, $2)")
///             .bind(cx.message_id().as_str())
///             .bind(&msg.payload()[..])
///             .execute(cx.db())
///             .await?;
///         Ok(())
///     }
///     fn batch(&self) -> Option<&dyn BatchHandler<sqlx::Postgres>> {
///         Some(self)
///     }
/// }
///
/// #[txinbox::async_trait]
/// impl BatchHandler<sqlx::Postgres> for Effects {
///     async fn handle_batch(
///         &self,
///         cx: &mut BatchContext<'_, sqlx::Postgres>,
///         batch: &[BatchMessage<'_>],
///     ) -> Result<(), HandlerError> {
///         let ids: Vec<&str> = batch.iter().map(|m| m.id().as_str()).collect();
///         let bodies: Vec<&[u8]> = batch.iter().map(|m| &m.message().payload()[..]).collect();
///         sqlx::query("INSERT INTO effects (message_id, body) SELECT * FROM UNNEST($1::text[], $2::bytea[])")
///             .bind(ids)
///             .bind(bodies)
///             .execute(cx.db())
///             .await?;
///         Ok(())
///     }
/// }
/// ```
#[async_trait]
pub trait BatchHandler<DB: sqlx::Database>: Send + Sync + 'static {
    /// Applies the effects of every message in `batch` using `cx.db()`. Must not end the
    /// transaction.
    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, DB>,
        batch: &[BatchMessage<'_>],
    ) -> Result<(), HandlerError>;
}

/// What a [`BatchHandler`] gets besides the messages: the batch's open transaction.
pub struct BatchContext<'a, DB: sqlx::Database> {
    pub(crate) conn: &'a mut TrackedTransaction<DB>,
    pub(crate) consumer: &'a str,
}

impl<DB: sqlx::Database> BatchContext<'_, DB> {
    /// The batch's transaction (the inbox rows of every message in it); as [`Context::db`]:
    /// after a failed statement nothing of the batch commits, and each message runs alone.
    pub fn db(&mut self) -> &mut TrackedTransaction<DB> {
        self.conn
    }

    /// The consumer's name.
    pub fn consumer(&self) -> &str {
        self.consumer
    }

    /// The downstream message ID [`Context::derive_id`] gives `message` for `step`, so a batch
    /// handler writes the same outbox rows as [`Handler::handle`] would for each message.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub fn derive_id(&self, message: &BatchMessage<'_>, step: &str) -> String {
        crate::outbox::derive_id(self.consumer, message.id.as_str(), step)
    }
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl<DB: crate::outbox::OutboxDatabase + crate::TrackedDatabase> BatchContext<'_, DB> {
    /// Writes `message` into the outbox in the batch's transaction; see [`Context::outbox`].
    pub async fn outbox(
        &mut self,
        message: &crate::outbox::OutboxMessage,
    ) -> Result<bool, crate::outbox::WriteError> {
        crate::outbox::write(&mut *self.conn, message).await
    }
}

impl<DB: sqlx::Database> fmt::Debug for BatchContext<'_, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchContext")
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

/// One new message of a batch, with what [`Context`] would tell about it.
#[derive(Debug, Clone, Copy)]
pub struct BatchMessage<'a> {
    pub(crate) message: &'a Message,
    pub(crate) id: &'a MessageId,
    pub(crate) attempt: u32,
    pub(crate) span: &'a tracing::Span,
}

impl<'a> BatchMessage<'a> {
    /// The message.
    pub fn message(&self) -> &'a Message {
        self.message
    }

    /// The message ID the inbox deduplicates on.
    pub fn id(&self) -> &'a MessageId {
        self.id
    }

    /// Which attempt this is, starting at 1 (see [`Context::attempt`]).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// This message's `txinbox.process` span. Run work done for this one message in it, e.g.
    /// `cx.outbox(&event).instrument(m.span().clone())`: with feature `otel` the outbox row
    /// then carries this message's trace context rather than the batch's.
    pub fn span(&self) -> &'a tracing::Span {
        self.span
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn via_question_mark<T, E>(r: Result<T, E>) -> HandlerError
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let f = || -> Result<T, HandlerError> { Ok(r?) };
        f().err().expect("an error")
    }

    #[test]
    fn decode_errors_raised_with_question_mark_are_undecodable() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Event {
            id: String,
        }
        for (input, category) in [
            (&b"{not json"[..], serde_json::error::Category::Syntax),
            (br#"{"id": 5}"#, serde_json::error::Category::Data),
            (br#"{"id": "a"#, serde_json::error::Category::Eof),
        ] {
            let e = serde_json::from_slice::<Event>(input).unwrap_err();
            assert_eq!(e.classify(), category);
            let e = via_question_mark(Err::<(), _>(e));
            assert!(e.is_permanent(), "{category:?}");
            assert_eq!(e.reason(), DeadLetterReason::Undecodable, "{category:?}");
        }
        let bytes = vec![0xff];
        let e = via_question_mark(std::str::from_utf8(&bytes));
        assert_eq!(
            (e.is_permanent(), e.reason()),
            (true, DeadLetterReason::Undecodable)
        );
        let e = via_question_mark(String::from_utf8(vec![0xff]));
        assert_eq!(
            (e.is_permanent(), e.reason()),
            (true, DeadLetterReason::Undecodable)
        );
    }

    #[test]
    fn io_and_other_errors_stay_transient() {
        struct Broken;
        impl std::io::Read for Broken {
            fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
                Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "peer went away",
                ))
            }
        }
        let e = serde_json::from_reader::<_, serde_json::Value>(Broken).unwrap_err();
        assert!(e.is_io());
        assert!(
            !via_question_mark(Err::<(), _>(e)).is_permanent(),
            "a reader's I/O error may pass"
        );
        assert!(!via_question_mark(Err::<(), _>("downstream busy")).is_permanent());
        let io = std::io::Error::other("disk full");
        assert!(!via_question_mark(Err::<(), _>(io)).is_permanent());
    }

    #[test]
    fn decode_takes_any_codec_and_its_errors_are_undecodable() {
        use crate::message::Origin;
        let msg = Message::new(&b"12x"[..], Origin::new("memory", "q"));
        let parsed = msg.decode(|p| std::str::from_utf8(p).map(str::len));
        assert_eq!(parsed.ok(), Some(3));
        let e = msg
            .decode(|p| -> Result<u32, Box<dyn std::error::Error + Send + Sync>> {
                Ok(std::str::from_utf8(p)?.parse()?)
            })
            .unwrap_err();
        assert_eq!(
            (e.is_permanent(), e.reason()),
            (true, DeadLetterReason::Undecodable)
        );
    }
}
