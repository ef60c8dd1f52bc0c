//! Errors and the exit codes they map to.

use std::fmt;

/// Exit codes, as documented in `txinbox --help` and the README.
pub mod exit {
    /// Done.
    pub const OK: i32 = 0;
    /// The operation failed or was refused (the message says why and what to do).
    pub const FAILED: i32 = 1;
    /// Bad arguments (also clap's code for usage errors).
    pub const BAD_ARGS: i32 = 2;
    /// A service (PostgreSQL, the SQLite file, Kafka, RabbitMQ) could not be reached.
    pub const UNREACHABLE: i32 = 3;
}

/// Why a command did not succeed.
#[derive(Debug)]
pub enum CliError {
    /// Refused or failed; exit 1.
    Failed(String),
    /// Bad arguments detected after parsing; exit 2.
    BadArgs(String),
    /// A service could not be reached; exit 3. `service` names it (never with a password).
    Unreachable {
        /// What was unreachable, e.g. `PostgreSQL at 127.0.0.1:5432/postgres`.
        service: String,
        /// The driver's message.
        detail: String,
    },
}

impl CliError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Failed(_) => exit::FAILED,
            CliError::BadArgs(_) => exit::BAD_ARGS,
            CliError::Unreachable { .. } => exit::UNREACHABLE,
        }
    }

    /// The same error with `note` appended to its message (e.g. what was done before it).
    pub fn with_note(self, note: &str) -> Self {
        match self {
            CliError::Failed(m) => CliError::Failed(format!("{m}; {note}")),
            CliError::BadArgs(m) => CliError::BadArgs(format!("{m}; {note}")),
            CliError::Unreachable { service, detail } => CliError::Unreachable {
                service,
                detail: format!("{detail}; {note}"),
            },
        }
    }

    /// A failure with this message.
    pub fn failed(message: impl Into<String>) -> Self {
        CliError::Failed(message.into())
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Failed(m) | CliError::BadArgs(m) => f.write_str(m),
            CliError::Unreachable { service, detail } => {
                write!(f, "cannot reach {service}: {detail}")
            }
        }
    }
}

/// A database error during an operation (after connecting). The database being unavailable
/// is decided by [`txinbox::store::is_unavailable`], the rule the consumer, the relay and
/// txinbox-http share: exit 3, not 1.
pub fn db(context: &str) -> impl FnOnce(txinbox::sqlx::Error) -> CliError + '_ {
    move |e| {
        use txinbox::sqlx::Error;
        match &e {
            e if txinbox::store::is_unavailable(e) => CliError::Unreachable {
                service: "the database".into(),
                detail: format!("{context}: {e} (retry once it is back)"),
            },
            // PostgreSQL's undefined_table; SQLite has no code of its own for it.
            Error::Database(d)
                if d.code().as_deref() == Some("42P01") || d.message().starts_with("no such table") =>
            {
                CliError::failed(format!(
                    "{context}: {e}. The txinbox tables are missing or older than this tool: run `txinbox migrate`"
                ))
            }
            _ => CliError::failed(format!("{context}: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use txinbox::sqlx::{self, Connection, Executor};
    use txinbox_testing::database::TestDatabase;

    use super::*;

    /// An operation that finds the database gone (its session ended, the database refusing
    /// connections) exits 3 "unreachable", as connecting does; the database's answer about the
    /// operation itself (a missing table) exits 1.
    #[tokio::test]
    async fn an_unavailable_database_exits_3_and_a_failed_operation_1() {
        let scratch = TestDatabase::builder("txinbox_cli_t")
            .max_connections(1)
            .create()
            .await;
        let mut held = sqlx::PgConnection::connect(scratch.url()).await.unwrap();
        held.execute("BEGIN").await.unwrap();
        scratch.refuse_connections().await;
        let ended = held.execute("SELECT 1").await.expect_err("session ended");
        assert_eq!(db("reading")(ended).exit_code(), exit::UNREACHABLE);
        let refused = scratch.pool().acquire().await.expect_err("refused");
        let refused = db("reading")(refused);
        assert_eq!(refused.exit_code(), exit::UNREACHABLE, "{refused}");
        scratch.allow_connections().await;

        let missing = scratch
            .pool()
            .execute("SELECT * FROM no_such_table")
            .await
            .expect_err("missing");
        assert_eq!(db("reading")(missing).exit_code(), exit::FAILED);
    }
}
