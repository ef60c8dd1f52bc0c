//! [`TrackedTransaction`]: the transaction a handler works in, which remembers a failed
//! statement so that the transaction is never committed after one.

use std::fmt;
use std::ops::{Deref, DerefMut};

use sqlx::{Database, Transaction};

#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use executor::TrackedDatabase;

/// The transaction a handler works in: the message's ([`Context::db`](crate::Context::db)) or
/// the request's (`txinbox_http::IdempotentTx`). Run statements on it as on a connection,
/// `sqlx::query(..).execute(cx.db())`: it is an [`sqlx::Executor`] and derefs to the
/// connection.
///
/// It remembers the first statement run through it that failed, and such a transaction is
/// never committed, whatever the handler returns afterwards: it is rolled back and the
/// message is retried (the consumer) or answered 500 with the key not used up (txinbox-http).
/// PostgreSQL does this itself (a failed statement aborts the transaction); SQLite does not
/// (it undoes the failed statement only and goes on), so without this a handler that ignored
/// an error would commit the statements before it. One rule for both stores.
///
/// To recover from a failure you expect, run the statement in a nested transaction (a
/// savepoint): `let mut sp = cx.db().begin().await?` (with `sqlx::Connection` in scope),
/// then `sp.rollback()` on failure. Statements on the nested transaction are the handler's
/// own and are not tracked, and neither are statements run on the connection itself (a
/// function that takes `&mut SqliteConnection`, reached through deref): on SQLite, a failure
/// there that the handler ignores is not seen, and what succeeded commits.
pub struct TrackedTransaction<DB: Database> {
    tx: Transaction<'static, DB>,
    failed: Option<String>,
}

/// A statement run on a [`TrackedTransaction`] failed and the handler went on: the
/// transaction was rolled back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatementFailed {
    error: String,
}

impl StatementFailed {
    /// The failed statement's error, as the database reported it.
    pub fn error(&self) -> &str {
        &self.error
    }
}

impl fmt::Display for StatementFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a database statement of the handler failed and the handler went on ({}); its transaction was rolled back, nothing was committed (propagate the error, or run a statement that may fail in a nested transaction)",
            self.error
        )
    }
}

impl std::error::Error for StatementFailed {}

impl<DB: Database> TrackedTransaction<DB> {
    /// Tracks the statements run on `tx` from now on.
    pub fn new(tx: Transaction<'static, DB>) -> Self {
        TrackedTransaction { tx, failed: None }
    }

    /// The error of the first statement run through this that failed, if any.
    pub fn failed_statement(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Rolls the transaction back.
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        self.tx.rollback().await
    }

    /// The transaction, whatever ran on it: for the runtime to roll it back through its store
    /// ([`InboxStore::rollback`](crate::InboxStore::rollback)).
    pub(crate) fn into_inner(self) -> Transaction<'static, DB> {
        self.tx
    }

    /// The transaction, to finish and commit, if no statement run through this failed;
    /// otherwise rolls it back.
    pub async fn into_transaction(self) -> Result<Transaction<'static, DB>, StatementFailed> {
        match self.checked() {
            Ok(tx) => Ok(tx),
            Err((tx, failed)) => {
                // NOTE: explicitly, so the connection is clean before it returns to the pool.
                drop(tx.rollback().await);
                Err(failed)
            }
        }
    }

    /// The transaction if no statement run through this failed; otherwise the transaction, for
    /// the runtime to roll back through its store, and the failure.
    pub(crate) fn checked(
        self,
    ) -> Result<Transaction<'static, DB>, (Transaction<'static, DB>, StatementFailed)> {
        match self.failed {
            None => Ok(self.tx),
            Some(error) => Err((self.tx, StatementFailed { error })),
        }
    }
}

impl<DB: Database> Deref for TrackedTransaction<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.tx
    }
}

impl<DB: Database> DerefMut for TrackedTransaction<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.tx
    }
}

impl<DB: Database> fmt::Debug for TrackedTransaction<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackedTransaction")
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

/// The executor: only with a store feature, which settles the shape of `sqlx::Executor`.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod executor {
    use futures::future::BoxFuture;
    use futures::stream::BoxStream;
    use futures::{FutureExt, StreamExt};
    use sqlx::{Database, Either, Execute, Executor, SqlStr};

    use super::TrackedTransaction;

    /// What [`Executor::fetch_many`] yields for `DB`.
    type Step<DB> = Result<Either<<DB as Database>::QueryResult, <DB as Database>::Row>, sqlx::Error>;

    mod sealed {
        pub trait Sealed {}
    }

    /// A database whose [`TrackedTransaction`] is an [`sqlx::Executor`]: `sqlx::Postgres` and
    /// `sqlx::Sqlite` (with txinbox's features of the same names); sealed. Generic handler code
    /// names it as a bound (`DB: TrackedDatabase`).
    pub trait TrackedDatabase: Database + sealed::Sealed {
        #[doc(hidden)]
        fn fetch_many<'e, 'q: 'e, E: 'q + Execute<'q, Self>>(
            conn: &'e mut Self::Connection,
            query: E,
        ) -> BoxStream<'e, Step<Self>>;

        #[doc(hidden)]
        fn fetch_optional<'e, 'q: 'e, E: 'q + Execute<'q, Self>>(
            conn: &'e mut Self::Connection,
            query: E,
        ) -> BoxFuture<'e, Result<Option<Self::Row>, sqlx::Error>>;

        #[doc(hidden)]
        fn prepare_with<'e>(
            conn: &'e mut Self::Connection,
            sql: SqlStr,
            parameters: &'e [Self::TypeInfo],
        ) -> BoxFuture<'e, Result<Self::Statement, sqlx::Error>>;

        #[doc(hidden)]
        fn describe<'e>(
            conn: &'e mut Self::Connection,
            sql: SqlStr,
        ) -> BoxFuture<'e, Result<sqlx::Describe<Self>, sqlx::Error>>;
    }

    /// The connection's own executor, for a database named concretely: a blanket impl bounded by
    /// `&mut DB::Connection: Executor` would send the trait solver round in circles.
    macro_rules! tracked_database {
        ($db:ty, $feature:literal) => {
            #[cfg(feature = $feature)]
            impl sealed::Sealed for $db {}

            #[cfg(feature = $feature)]
            impl TrackedDatabase for $db {
                fn fetch_many<'e, 'q: 'e, E: 'q + Execute<'q, Self>>(
                    conn: &'e mut Self::Connection,
                    query: E,
                ) -> BoxStream<'e, Step<Self>> {
                    conn.fetch_many(query)
                }

                fn fetch_optional<'e, 'q: 'e, E: 'q + Execute<'q, Self>>(
                    conn: &'e mut Self::Connection,
                    query: E,
                ) -> BoxFuture<'e, Result<Option<Self::Row>, sqlx::Error>> {
                    conn.fetch_optional(query)
                }

                fn prepare_with<'e>(
                    conn: &'e mut Self::Connection,
                    sql: SqlStr,
                    parameters: &'e [Self::TypeInfo],
                ) -> BoxFuture<'e, Result<Self::Statement, sqlx::Error>> {
                    conn.prepare_with(sql, parameters)
                }

                // NOTE: `Executor::describe` exists when sqlx-core's `offline` feature is on: txinbox's
                // `postgres` and `sqlite` features turn it on (through `sqlx/macros`).
                fn describe<'e>(
                    conn: &'e mut Self::Connection,
                    sql: SqlStr,
                ) -> BoxFuture<'e, Result<sqlx::Describe<Self>, sqlx::Error>> {
                    conn.describe(sql)
                }
            }
        };
    }

    tracked_database!(sqlx::Postgres, "postgres");
    tracked_database!(sqlx::Sqlite, "sqlite");

    /// Every statement goes to the connection; an error on the way back is noted.
    impl<'c, DB: TrackedDatabase> Executor<'c> for &'c mut TrackedTransaction<DB> {
        type Database = DB;

        fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Step<DB>>
        where
            'c: 'e,
            E: 'q + Execute<'q, DB>,
        {
            let TrackedTransaction { tx, failed } = self;
            DB::fetch_many(tx, query)
                .inspect(move |r| {
                    if let Err(e) = r {
                        note(failed, e);
                    }
                })
                .boxed()
        }

        fn fetch_optional<'e, 'q: 'e, E>(
            self,
            query: E,
        ) -> BoxFuture<'e, Result<Option<DB::Row>, sqlx::Error>>
        where
            'c: 'e,
            E: 'q + Execute<'q, DB>,
        {
            let TrackedTransaction { tx, failed } = self;
            DB::fetch_optional(tx, query)
                .inspect(move |r| {
                    if let Err(e) = r {
                        note(failed, e);
                    }
                })
                .boxed()
        }

        fn prepare_with<'e>(
            self,
            sql: SqlStr,
            parameters: &'e [DB::TypeInfo],
        ) -> BoxFuture<'e, Result<DB::Statement, sqlx::Error>>
        where
            'c: 'e,
        {
            let TrackedTransaction { tx, failed } = self;
            DB::prepare_with(tx, sql, parameters)
                .inspect(move |r| {
                    if let Err(e) = r {
                        note(failed, e);
                    }
                })
                .boxed()
        }

        fn describe<'e>(self, sql: SqlStr) -> BoxFuture<'e, Result<sqlx::Describe<DB>, sqlx::Error>>
        where
            'c: 'e,
        {
            DB::describe(&mut self.tx, sql)
        }
    }

    fn note(failed: &mut Option<String>, e: &sqlx::Error) {
        failed.get_or_insert_with(|| e.to_string());
    }
}
